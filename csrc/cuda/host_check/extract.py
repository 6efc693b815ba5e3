"""Extracts the device code of csrc/cuda/quant_cuda.cu, verbatim, for the host emulation in
harness.cpp: the kernels and the device helpers they call, plus the few host helpers the
harness needs to launch them the way the ops do (make_klayout, fits_32bit, grid_for, aligned16,
observe_config, bits_steps). Left out: the ATen glue (launchers, workspace cache, op entry
points, make_krows / contiguous_rows, which read at::Tensor), which needs CUDA headers.

Each region is given by markers of the .cu file (section headers `// ---- ... name` and the
first line of a definition), so a moved boundary fails here with the marker's name, and the
result is checked for host-only tokens (a region that swallowed glue fails here too, not as
a compile error deep in the harness)."""
import re
import sys

src = open(sys.argv[1]).read().split('\n')


def find(what, pred, start=0):
    for i in range(start, len(src)):
        if pred(src[i]):
            return i
    raise SystemExit(f'extract.py: marker not found in {sys.argv[1]}: {what}')


def starts(prefix, start=0):
    return find(repr(prefix), lambda l: l.startswith(prefix), start)


def section(name):
    return find(f'section "{name}"', lambda l: l.startswith('// ----') and l.rstrip().endswith(' ' + name))


def head_of(i):
    """First line of the definition at line i: back over its template line and comment."""
    while i > 0 and (src[i - 1].startswith('template') or src[i - 1].startswith('//')):
        i -= 1
    return i


def end_of(i):
    """One past the closing brace (column 0) of the top-level definition starting at line i."""
    return find(f'end of the definition at line {i + 1}', lambda l: l.startswith('}'), i) + 1


out = []


def region(a, b):  # lines [a, b)
    out.extend(src[a:b])
    out.append('')


def section_until(name, first_glue):
    """Section `name` from its header to the definition (and its comment) starting with
    `first_glue`, the section's first host entry point."""
    a = section(name)
    region(a, head_of(starts(first_glue, a)))


# division, layout (KLayout, make_klayout, fits_32bit, param_of), row scales without
# make_krows (KRows is built by the harness), vector I/O
a = starts('constexpr int kThreads')
krows = starts('KRows<IdxT> make_krows(', a)
region(a, head_of(krows))
region(end_of(krows), section('host helpers'))
# host helpers: the launch shapes and the alignment test the ops' path choices use (sm_count
# and contiguous_rows are ATen / CUDA glue)
a = starts('int grid_for(', section('host helpers'))
region(head_of(a), end_of(a))
a = starts('int warp_rows_grid(', a)
region(head_of(a), a + 1)
a = starts('bool aligned16(', a)
region(a, a + 1)
section_until('quantize', 'void launch_quantize')
section_until('dequantize', 'int block_table_of(')
section_until('bit widths', 'void launch_quantize_bits')
region(section('min/max encoding'), section('workspace'))
a = starts('constexpr int64_t kWsHeader', section('workspace'))
region(a, a + 1)
section_until('observe', 'void launch_observe')
section_until('quantize_observe', 'std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_observe_cuda(')
section_until('update_estimates', 'std::tuple<at::Tensor, at::Tensor> launch_update_estimates(')
section_until('row_exponents', 'void launch_row_finish_grid(')
section_until('observe_rows', 'void launch_row_cells_flat(')
section_until('softmax_backward', 'void launch_softmax_backward(')
section_until('layer_norm_backward', 'void launch_layer_norm_backward(')

# host-only tokens: ATen / CUDA runtime glue must not reach the harness
glue = re.compile(r'\bat::|c10::cuda|C10_CUDA|<<<|cudaStream_t|cuda[A-Z]\w*\(|TORCH_')
bad = [f'{n + 1}: {l.strip()}' for n, l in enumerate(out) if glue.search(l) and not l.lstrip().startswith('//')]
if bad:
    raise SystemExit('extract.py: host glue in the extracted device code (a section boundary moved?):\n  '
                     + '\n  '.join(bad[:10]))
print('\n'.join(out))
