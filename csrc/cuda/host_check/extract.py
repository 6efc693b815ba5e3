import sys
src = open(sys.argv[1]).read().split('\n')
def idx(pred, start=0):
    for i in range(start, len(src)):
        if pred(src[i]): return i
    raise SystemExit('marker not found')
out = []
def region(a, b):  # [a, b)
    out.extend(src[a:b]); out.append('')
a = idx(lambda l: l.startswith('constexpr int kThreads'))
b = idx(lambda l: l.startswith('// Streaming multiprocessors'))
region(a, b)
a = idx(lambda l: l.startswith('bool aligned('))
region(a, a + 1)
a = idx(lambda l: l.startswith('__global__ void build_tables_kernel'))
b = idx(lambda l: l.startswith('at::Tensor build_tables('))
region(a, b)
a = idx(lambda l: 'quantize' in l and l.startswith('// ----') and 'dequantize' not in l)
b = idx(lambda l: l.startswith('void launch_quantize'), a) - 1
region(a, b)
a = idx(lambda l: 'dequantize' in l and l.startswith('// ----'))
b = idx(lambda l: l.startswith('void launch_dequantize'), a) - 1
region(a, b)
a = idx(lambda l: 'minmax' in l and l.startswith('// ----'))
b = idx(lambda l: l.startswith('std::tuple<at::Tensor, at::Tensor> group_minmax_cuda'), a)
region(a, b)
a = idx(lambda l: l.startswith('// The whole running-estimate update'))
b = idx(lambda l: l.startswith('std::tuple<at::Tensor, at::Tensor> update_estimates_cuda'), a)
region(a, b)
print('\n'.join(out))
