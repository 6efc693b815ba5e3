"""Extracts the device code of csrc/cuda/quant_cuda.cu (everything but the ATen glue:
launchers, workspace cache, op entry points) for the host emulation in harness.cpp."""
import sys

src = open(sys.argv[1]).read().split('\n')


def idx(pred, start=0):
    for i in range(start, len(src)):
        if pred(src[i]):
            return i
    raise SystemExit('marker not found')


def section(name):
    return idx(lambda l: l.startswith('// ----') and l.rstrip().endswith(' ' + name))


out = []


def region(a, b):  # [a, b)
    out.extend(src[a:b])
    out.append('')


region(idx(lambda l: l.startswith('constexpr int kThreads')), section('host helpers'))
a = idx(lambda l: l.startswith('int grid_for('))
region(a, idx(lambda l: l.startswith('bool aligned16('), a) + 1)
a = section('quantize')
region(a, idx(lambda l: l.startswith('void launch_quantize'), a) - 1)
a = section('dequantize')
region(a, idx(lambda l: l.startswith('void launch_dequantize'), a) - 1)
a = section('bit widths')
region(a, idx(lambda l: l.startswith('void launch_quantize_bits'), a) - 1)
region(section('min/max encoding'), section('workspace'))
a = idx(lambda l: l.startswith('constexpr int64_t kWsHeader'))
region(a, a + 1)
a = section('observe')
region(a, idx(lambda l: l.startswith('template <int MODE>'), a))
a = idx(lambda l: l.startswith('// The whole running-estimate update'))
region(a, idx(lambda l: l.startswith('std::tuple<at::Tensor, at::Tensor> update_estimates_cuda'), a))
print('\n'.join(out))
