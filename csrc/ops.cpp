// Operator definitions (TORCH_LIBRARY(mesa, m)), argument checks shared by the CPU and
// CUDA kernels, and the (empty) Python module `mesa_train._C`.
//
// Importing mesa_train._C runs the static registrations below; the Python side
// (mesa_train/quant/__init__.py) adds the fake implementations and the autograd
// registration. Kernels: csrc/quant_cpu.cpp (CPU), csrc/cuda/quant_cuda.cu (CUDA).
#include <Python.h>

#include <torch/library.h>

#include "mesa_common.h"

extern "C" {
// Empty module: all functionality is reached through torch.ops.mesa.*. Built against the
// limited API (abi3), so one wheel serves every CPython >= 3.9.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",  // name
      "mesa_train C++/CUDA kernels; the ops live in torch.ops.mesa",
      -1,    // size
      NULL,  // methods
  };
  return PyModule_Create(&module_def);
}
}

namespace mesa {

static bool is_quant_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

static int64_t normalize_dim(const at::Tensor& x, int64_t dim) {
  const int64_t nd = x.dim();
  TORCH_CHECK_VALUE(nd > 0, "mesa: quantization ops need a tensor with at least one dimension");
  TORCH_CHECK_VALUE(dim >= -nd && dim < nd, "mesa: dim ", dim, " out of range for a ", nd,
                    "-d tensor of shape ", x.sizes());
  return dim < 0 ? dim + nd : dim;
}

static int64_t normalize_dim_sizes(at::IntArrayRef sizes, int64_t dim) {
  const int64_t nd = static_cast<int64_t>(sizes.size());
  TORCH_CHECK_VALUE(nd > 0, "mesa: quantization ops need a tensor with at least one dimension");
  TORCH_CHECK_VALUE(dim >= -nd && dim < nd, "mesa: dim ", dim, " out of range for a ", nd,
                    "-d tensor of shape ", sizes);
  return dim < 0 ? dim + nd : dim;
}

static Layout make_layout_sizes(at::IntArrayRef sizes, int64_t dim, int64_t num_groups, int64_t S) {
  Layout L;
  L.dim = normalize_dim_sizes(sizes, dim);
  L.D = sizes[L.dim];
  TORCH_CHECK_VALUE(num_groups >= 1 && (L.D == 0 || num_groups <= L.D), "mesa: num_groups=",
                    num_groups, " must be in [1, ", L.D, "] (size of dim ", L.dim, " of shape ",
                    sizes, ")");
  L.G = num_groups;
  L.numel = 1;
  for (int64_t s : sizes) L.numel *= s;
  for (int64_t k = 0; k < L.dim; ++k) L.outer *= sizes[k];
  for (int64_t k = L.dim + 1; k < static_cast<int64_t>(sizes.size()); ++k) L.inner *= sizes[k];
  L.S = S;
  L.dim0_per_sample = (S > 1 && L.dim == 0);
  L.s_eff = (S > 1 && L.dim > 0) ? S : 1;
  L.outer_per_s = L.s_eff > 0 ? L.outer / L.s_eff : 0;
  return L;
}

Layout make_layout(const at::Tensor& x, int64_t dim, int64_t num_groups, int64_t S) {
  normalize_dim(x, dim);
  return make_layout_sizes(x.sizes(), dim, num_groups, S);
}

static int64_t check_params(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta,
                            int64_t num_groups) {
  for (const at::Tensor* p : {&alpha, &beta}) {
    const char* name = p == &alpha ? "alpha" : "beta";
    TORCH_CHECK_VALUE(p->scalar_type() == at::kFloat, "mesa: ", name, " must be float32, got ",
                      p->scalar_type());
    TORCH_CHECK_VALUE(p->device() == x.device(), "mesa: ", name, " is on ", p->device(),
                      " but the input is on ", x.device());
  }
  TORCH_CHECK_VALUE(alpha.dim() == 2 && alpha.sizes() == beta.sizes(),
                    "mesa: alpha and beta must both have shape (S, ", num_groups, "); got ",
                    alpha.sizes(), " and ", beta.sizes());
  const int64_t S = alpha.size(0);
  TORCH_CHECK_VALUE(alpha.size(1) == num_groups && (S == 1 || S == x.size(0)),
                    "mesa: alpha/beta shape ", alpha.sizes(), " invalid: expected (S, ", num_groups,
                    ") with S in {1, ", x.size(0), "} (shared or per-sample statistics)");
  return S;
}

static void check_bits(int64_t bits) {
  TORCH_CHECK_VALUE(bits == 8 || bits == 4 || bits == 2, "mesa: bits must be one of 8, 4, 2, got ", bits);
}

int64_t packed_bytes(int64_t numel, int64_t bits) {
  const int64_t per = 8 / bits;
  return (numel + per - 1) / per;
}

Layout check_quantize_bits(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta, int64_t dim,
                           int64_t num_groups, int64_t bits, const at::Tensor& seed) {
  check_bits(bits);
  return check_quantize(x, alpha, beta, dim, num_groups, seed);
}

Layout check_dequantize_bits(const at::Tensor& q, const at::Tensor& alpha, const at::Tensor& beta,
                             at::IntArrayRef shape, int64_t dim, int64_t num_groups, int64_t bits,
                             at::ScalarType dtype) {
  check_bits(bits);
  TORCH_CHECK_VALUE(q.scalar_type() == at::kByte && q.dim() == 1,
                    "mesa: dequantize_bits expects a 1-d uint8 tensor of packed codes, got ", q.scalar_type(),
                    q.sizes());
  TORCH_CHECK_VALUE(is_quant_dtype(dtype),
                    "mesa: dequantize_bits can produce float32, float16 or bfloat16, got ", dtype);
  for (int64_t s : shape) TORCH_CHECK_VALUE(s >= 0, "mesa: dequantize_bits: negative size in shape ", shape);
  normalize_dim_sizes(shape, dim);
  for (const at::Tensor* p : {&alpha, &beta}) {
    const char* name = p == &alpha ? "alpha" : "beta";
    TORCH_CHECK_VALUE(p->scalar_type() == at::kFloat, "mesa: ", name, " must be float32, got ", p->scalar_type());
    TORCH_CHECK_VALUE(p->device() == q.device(), "mesa: ", name, " is on ", p->device(), " but the codes are on ",
                      q.device());
  }
  TORCH_CHECK_VALUE(alpha.dim() == 2 && alpha.sizes() == beta.sizes() && alpha.size(1) == num_groups &&
                        (alpha.size(0) == 1 || alpha.size(0) == shape[0]),
                    "mesa: alpha/beta shapes ", alpha.sizes(), " and ", beta.sizes(), " invalid: expected (S, ",
                    num_groups, ") with S in {1, ", shape[0], "} (shared or per-sample statistics)");
  const Layout L = make_layout_sizes(shape, dim, num_groups, alpha.size(0));
  TORCH_CHECK_VALUE(q.size(0) == packed_bytes(L.numel, bits), "mesa: dequantize_bits: ", q.size(0),
                    " bytes of codes, but shape ", shape, " at ", bits, " bits needs ", packed_bytes(L.numel, bits));
  return L;
}

Layout check_minmax(const at::Tensor& x, int64_t dim, int64_t num_groups, bool per_sample) {
  TORCH_CHECK_VALUE(is_quant_dtype(x.scalar_type()),
                    "mesa: group_minmax supports float32, float16 and bfloat16 inputs, got ",
                    x.scalar_type());
  const int64_t nd = normalize_dim(x, dim);
  const int64_t S = per_sample ? x.size(0) : 1;
  return make_layout(x, nd, num_groups, S);
}

Layout check_quantize(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta,
                      int64_t dim, int64_t num_groups, const at::Tensor& seed) {
  TORCH_CHECK_VALUE(is_quant_dtype(x.scalar_type()),
                    "mesa: quantize supports float32, float16 and bfloat16 inputs, got ",
                    x.scalar_type());
  normalize_dim(x, dim);
  const int64_t S = check_params(x, alpha, beta, num_groups);
  check_seed_tensor("quantize: seed ([lo, hi])", seed, x.device());
  return make_layout(x, dim, num_groups, S);
}

Layout check_dequantize(const at::Tensor& q, const at::Tensor& alpha, const at::Tensor& beta,
                        int64_t dim, int64_t num_groups, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(q.scalar_type() == at::kByte, "mesa: dequantize expects a uint8 tensor, got ",
                    q.scalar_type());
  TORCH_CHECK_VALUE(is_quant_dtype(dtype),
                    "mesa: dequantize can produce float32, float16 or bfloat16, got ", dtype);
  normalize_dim(q, dim);
  const int64_t S = check_params(q, alpha, beta, num_groups);
  return make_layout(q, dim, num_groups, S);
}

// g and the codes q of one shape and device (a backward from codes); the normalized dim
static int64_t check_codes_backward(const char* op, const at::Tensor& g, const at::Tensor& q, int64_t dim) {
  TORCH_CHECK_VALUE(is_quant_dtype(g.scalar_type()), "mesa: ", op, ": g must be float32, float16 or bfloat16, got ",
                    g.scalar_type());
  TORCH_CHECK_VALUE(q.scalar_type() == at::kByte, "mesa: ", op, " expects uint8 codes q, got ", q.scalar_type());
  TORCH_CHECK_VALUE(g.device() == q.device(), "mesa: ", op, ": g is on ", g.device(), " but the codes are on ",
                    q.device());
  TORCH_CHECK_VALUE(g.sizes() == q.sizes(), "mesa: ", op, ": g has shape ", g.sizes(), " but the codes have ",
                    q.sizes());
  return normalize_dim(q, dim);
}

Layout check_gelu_backward(const at::Tensor& g, const at::Tensor& q, const at::Tensor& alpha,
                           const at::Tensor& beta, int64_t dim, int64_t num_groups) {
  const int64_t nd = check_codes_backward("gelu_backward", g, q, dim);
  make_layout(q, nd, num_groups, 1);  // the num_groups range first, as the reference checks it
  const int64_t S = check_params(q, alpha, beta, num_groups);
  return make_layout(q, nd, num_groups, S);
}

SoftmaxBwdKind softmax_backward_kind(const at::Tensor& g, std::optional<at::ScalarType> y_dtype,
                                     std::optional<at::ScalarType> out_dtype) {
  const at::ScalarType gt = g.scalar_type();
  const bool map_float = y_dtype.has_value() && *y_dtype != gt;
  TORCH_CHECK_VALUE(!map_float || *y_dtype == at::kFloat, "mesa: softmax_backward: y_dtype must be None, g's dtype (",
                    gt, ") or float32, got ", *y_dtype);
  const bool out_float = out_dtype.has_value() && *out_dtype != gt;
  TORCH_CHECK_VALUE(!out_float || (*out_dtype == at::kFloat && map_float),
                    "mesa: softmax_backward: out_dtype must be None, g's dtype (", gt,
                    ") or float32 with y_dtype float32, got ", *out_dtype);
  return out_float ? SoftmaxBwdKind::kMapFloatOutFloat
                   : map_float ? SoftmaxBwdKind::kMapFloat : SoftmaxBwdKind::kPlain;
}

Layout check_softmax_backward(const at::Tensor& g, const at::Tensor& q, const at::Tensor& alpha,
                              const at::Tensor& beta, int64_t dim, int64_t num_groups,
                              std::optional<at::ScalarType> y_dtype, std::optional<at::ScalarType> out_dtype) {
  const int64_t nd = check_codes_backward("softmax_backward", g, q, dim);
  softmax_backward_kind(g, y_dtype, out_dtype);
  // one (alpha, beta) per row (a slice along the last dim) is what lets a row be reduced alone
  TORCH_CHECK_VALUE(nd != q.dim() - 1, "mesa: softmax_backward: the group dim ", nd,
                    " is the softmax (last) dim of shape ", q.sizes(),
                    ", so a row has several (alpha, beta); valid: a group dim < ", nd,
                    " (else use dequantize + torch._softmax_backward_data)");
  make_layout(q, nd, num_groups, 1);  // the num_groups range first, as the reference checks it
  const int64_t S = check_params(q, alpha, beta, num_groups);
  return make_layout(q, nd, num_groups, S);
}

// layer_norm_backward (DESIGN.md, "LayerNorm backward from the codes"): g and q of one shape,
// groups along the last dim, rows of at most kLnMaxCols, rstd one float32 per row, weight
// None or float32 (D,), row_exp one int8 per row of the last dim. Checked after the tensors
// are known to be on one device; returns the layout (dim = the last).
Layout check_layer_norm_backward(const at::Tensor& g, const at::Tensor& q, const at::Tensor& alpha,
                                 const at::Tensor& beta, int64_t num_groups, const at::Tensor& rstd,
                                 const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& row_exp) {
  const int64_t nd = check_codes_backward("layer_norm_backward", g, q, -1);
  make_layout(q, nd, num_groups, 1);  // the num_groups range first, as the reference checks it
  const int64_t S = check_params(q, alpha, beta, num_groups);
  TORCH_CHECK_VALUE(S == 1 || q.dim() >= 2, "mesa: layer_norm_backward: per-sample statistics need codes with a ",
                    "sample dim and a row dim, got shape ", q.sizes());
  const int64_t D = q.size(-1);
  TORCH_CHECK_VALUE(D <= kLnMaxCols, "mesa: layer_norm_backward: rows of ", D, " elements; valid: at most ",
                    kLnMaxCols, " (wider LayerNorms use dequantize + aten.native_layer_norm_backward)");
  const int64_t rows = D > 0 ? q.numel() / D : 0;
  TORCH_CHECK_VALUE(rstd.scalar_type() == at::kFloat && rstd.device() == q.device(),
                    "mesa: layer_norm_backward: rstd must be a float32 tensor on ", q.device(), ", got ",
                    rstd.scalar_type(), " on ", rstd.device());
  TORCH_CHECK_VALUE(rstd.numel() == rows, "mesa: layer_norm_backward: rstd must hold one value per row (", rows,
                    " rows of ", D, " for codes of shape ", q.sizes(), "), got shape ", rstd.sizes());
  if (weight.has_value() && weight->defined()) {
    const at::Tensor& w = *weight;
    TORCH_CHECK_VALUE(w.scalar_type() == at::kFloat && w.device() == q.device() && w.dim() == 1 && w.size(0) == D,
                      "mesa: layer_norm_backward: weight must be None or a float32 (", D, ",) tensor on ", q.device(),
                      ", got ", w.scalar_type(), w.sizes(), " on ", w.device());
  }
  check_row_exp("layer_norm_backward", q.sizes(), q.device(), row_exp);
  if (row_exp.has_value() && row_exp->defined()) {
    TORCH_CHECK_VALUE(row_exp->numel() == rows, "mesa: layer_norm_backward: row_exp must hold one exponent per row ",
                      "of the last dim (", rows, "), got shape ", row_exp->sizes());
  }
  return make_layout(q, nd, num_groups, S);
}

// The estimate state of update_estimates / observe: (G_buf,) float32 buffers with
// G_buf >= G, a one-element bool flag, all on `device`, and decay in [0, 1).
static void check_estimate_state(const char* op, int64_t G, const at::Tensor& alpha_est, const at::Tensor& beta_est,
                                 const at::Tensor& initialized, const c10::Device& device, double decay) {
  for (const at::Tensor* p : {&alpha_est, &beta_est}) {
    const char* name = p == &alpha_est ? "alpha_est" : "beta_est";
    TORCH_CHECK_VALUE(p->scalar_type() == at::kFloat && p->dim() == 1 && p->is_contiguous() && p->size(0) >= G,
                      "mesa: ", op, ": ", name, " must be a contiguous float32 (G_buf,) tensor with G_buf >= ", G,
                      ", got ", p->scalar_type(), p->sizes());
  }
  TORCH_CHECK_VALUE(initialized.scalar_type() == at::kBool && initialized.numel() == 1, "mesa: ", op,
                    ": initialized must be a one-element bool tensor, got ", initialized.scalar_type(),
                    initialized.sizes());
  for (const at::Tensor* p : {&alpha_est, &beta_est, &initialized}) {
    TORCH_CHECK_VALUE(p->device() == device, "mesa: ", op, ": all tensors must be on ", device, ", got one on ",
                      p->device());
  }
  TORCH_CHECK_VALUE(decay >= 0.0 && decay < 1.0, "mesa: ", op, ": decay must be in [0, 1), got ", decay);
}

int64_t check_update_estimates(const at::Tensor& mn, const at::Tensor& mx, const at::Tensor& alpha_est,
                               const at::Tensor& beta_est, const at::Tensor& initialized, double decay,
                               bool per_sample) {
  TORCH_CHECK_VALUE(mn.scalar_type() == at::kFloat && mx.scalar_type() == at::kFloat && mn.dim() == 2 &&
                        mn.sizes() == mx.sizes(),
                    "mesa: update_estimates: min and max must be float32 (S, G) tensors of one shape, got ",
                    mn.scalar_type(), mn.sizes(), " and ", mx.scalar_type(), mx.sizes());
  TORCH_CHECK_VALUE(per_sample || mn.size(0) == 1,
                    "mesa: update_estimates: shared statistics must have shape (1, G), got ", mn.sizes());
  TORCH_CHECK_VALUE(mx.device() == mn.device(), "mesa: update_estimates: all tensors must be on ", mn.device(),
                    ", got one on ", mx.device());
  const int64_t G = mn.size(1);
  check_estimate_state("update_estimates", G, alpha_est, beta_est, initialized, mn.device(), decay);
  return G;
}

void check_seed_tensor(const char* what, const at::Tensor& t, const c10::Device& device) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == 2, "mesa: ", what,
                    " must be an int64 tensor of shape (2,), got ", t.scalar_type(), t.sizes());
  TORCH_CHECK_VALUE(t.device() == device, "mesa: ", what, " is on ", t.device(), " but the input is on ", device);
}

int64_t check_estimate_and_seed(const at::Tensor& mn, const at::Tensor& mx, const at::Tensor& alpha_est,
                                const at::Tensor& beta_est, const at::Tensor& initialized, const at::Tensor& rng,
                                double decay, bool per_sample) {
  const int64_t G = check_update_estimates(mn, mx, alpha_est, beta_est, initialized, decay, per_sample);
  check_seed_tensor("estimate_and_seed: rng ([key, counter])", rng, mn.device());
  return G;
}

Layout check_observe(const at::Tensor& x, const at::Tensor& alpha_est, const at::Tensor& beta_est,
                     const at::Tensor& initialized, const at::Tensor& rng, int64_t dim, int64_t num_groups,
                     double decay, bool per_sample) {
  TORCH_CHECK_VALUE(is_quant_dtype(x.scalar_type()),
                    "mesa: observe supports float32, float16 and bfloat16 inputs, got ", x.scalar_type());
  const int64_t nd = normalize_dim(x, dim);
  const Layout L = make_layout(x, nd, num_groups, per_sample ? x.size(0) : 1);
  check_estimate_state("observe", num_groups, alpha_est, beta_est, initialized, x.device(), decay);
  check_seed_tensor("observe: rng ([key, counter])", rng, x.device());
  return L;
}

// t's shape is x.shape[:-n] + (1,) * n for an n >= 1: one entry per row of x's last n dims (t's
// trailing size-1 dims are taken as the row dims)
static bool one_per_row(at::IntArrayRef t_sizes, at::IntArrayRef x_sizes) {
  const int64_t nd = static_cast<int64_t>(x_sizes.size()), td = static_cast<int64_t>(t_sizes.size());
  int64_t n = 0;
  while (n < td && t_sizes[td - 1 - n] == 1) ++n;
  bool ok = td == nd && n >= 1;
  for (int64_t d = 0; ok && d < nd - n; ++d) ok = t_sizes[d] == x_sizes[d];
  return ok;
}

// elements per row (0: an empty tensor or no rows)
static int64_t row_length(at::IntArrayRef x_sizes, int64_t rows) {
  int64_t numel = 1;
  for (int64_t s : x_sizes) numel *= s;
  return (numel == 0 || rows == 0) ? 0 : numel / rows;
}

int64_t check_row_exp(const char* op, at::IntArrayRef x_sizes, const c10::Device& device,
                      const std::optional<at::Tensor>& row_exp) {
  if (!row_exp.has_value() || !row_exp->defined()) return 0;
  const at::Tensor& k = *row_exp;
  TORCH_CHECK_VALUE(k.scalar_type() == at::kChar, "mesa: ", op, ": row_exp must be int8, got ", k.scalar_type());
  TORCH_CHECK_VALUE(k.device() == device, "mesa: ", op, ": row_exp is on ", k.device(), " but the input is on ",
                    device);
  TORCH_CHECK_VALUE(one_per_row(k.sizes(), x_sizes), "mesa: ", op, ": row_exp must have shape x.shape[:-n] + (1,) * n ",
                    "(one exponent per row of the last n >= 1 dims); got ", k.sizes(), " for x of shape ", x_sizes);
  return row_length(x_sizes, k.numel());
}

// a float32 per-row argument `name` of op on `device` (row_mean, row_rstd, row_mul)
static void check_float_rows(const char* op, const char* name, const at::Tensor& t, const c10::Device& device,
                             const char* x_is_on) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, "mesa: ", op, ": ", name, " must be float32, got ",
                    t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == device, "mesa: ", op, ": ", name, " is on ", t.device(), " but ", x_is_on, " ",
                    device);
}

int64_t check_row_norm(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& row_mean,
                       const std::optional<at::Tensor>& row_rstd) {
  const bool has_mean = row_mean.has_value() && row_mean->defined();
  const bool has_rstd = row_rstd.has_value() && row_rstd->defined();
  if (!has_mean && !has_rstd) return 0;
  TORCH_CHECK_VALUE(has_mean && has_rstd, "mesa: ", op, ": row_mean and row_rstd go together (LayerNorm's per-row ",
                    "mean and rstd); got only ", has_mean ? "row_mean" : "row_rstd");
  check_float_rows(op, "row_mean", *row_mean, x.device(), "the input is on");
  check_float_rows(op, "row_rstd", *row_rstd, x.device(), "the input is on");
  TORCH_CHECK_VALUE(is_quant_dtype(x.scalar_type()), "mesa: ", op, ": with row_mean / row_rstd the input must be ",
                    "float32, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(row_mean->sizes() == row_rstd->sizes(), "mesa: ", op, ": row_mean and row_rstd must have one ",
                    "shape, got ", row_mean->sizes(), " and ", row_rstd->sizes());
  TORCH_CHECK_VALUE(one_per_row(row_mean->sizes(), x.sizes()), "mesa: ", op, ": row_mean and row_rstd must have ",
                    "shape x.shape[:-n] + (1,) * n (one per row of the last n >= 1 dims); got ", row_mean->sizes(),
                    " for x of shape ", x.sizes());
  return row_length(x.sizes(), row_mean->numel());
}

int64_t check_row_mul(const char* op, const at::Tensor& q, const std::optional<at::Tensor>& row_mul) {
  if (!row_mul.has_value() || !row_mul->defined()) return 0;
  const at::Tensor& m = *row_mul;
  check_float_rows(op, "row_mul", m, q.device(), "the codes are on");
  TORCH_CHECK_VALUE(one_per_row(m.sizes(), q.sizes()), "mesa: ", op, ": row_mul must have shape q.shape[:-n] + ",
                    "(1,) * n (one factor per row of the last n >= 1 dims); got ", m.sizes(), " for codes of shape ",
                    q.sizes());
  return row_length(q.sizes(), m.numel());
}

bool check_cols(const char* op, const at::Tensor& q, const std::optional<at::Tensor>& col_scale,
                const std::optional<at::Tensor>& col_shift) {
  bool any = false;
  for (const auto& [name, t] : {std::pair{"col_scale", &col_scale}, std::pair{"col_shift", &col_shift}}) {
    if (!t->has_value() || !(*t)->defined()) continue;
    any = true;
    check_float_rows(op, name, **t, q.device(), "the codes are on");
    TORCH_CHECK_VALUE(q.dim() >= 1 && (*t)->dim() == 1 && (*t)->size(0) == q.size(-1), "mesa: ", op, ": ", name,
                      " must have shape (C,) with C = q.shape[-1] (one value per column of the last dim); got ",
                      (*t)->sizes(), " for codes of shape ", q.sizes());
  }
  return any;
}

void affine_cols_inplace(at::Tensor& y, const std::optional<at::Tensor>& col_scale,
                         const std::optional<at::Tensor>& col_shift) {
  if (col_scale.has_value() && col_scale->defined()) y.mul_(*col_scale);
  if (col_shift.has_value() && col_shift->defined()) y.add_(*col_shift);
}

void multiply_rows_inplace(at::Tensor& y, const std::optional<at::Tensor>& row_mul) {
  if (!row_mul.has_value() || !row_mul->defined() || y.numel() == 0) return;
  if (y.scalar_type() == at::kFloat) y.mul_(*row_mul);
  else y.copy_(y.to(at::kFloat).mul_(*row_mul));
}

at::Tensor normalized_rows(const at::Tensor& x, const std::optional<at::Tensor>& row_mean,
                           const std::optional<at::Tensor>& row_rstd) {
  if (!row_mean.has_value() || !row_mean->defined()) return x;
  at::Tensor xh = x.to(at::kFloat).sub(*row_mean);
  return xh.mul_(*row_rstd);
}

int64_t check_row_exponents(const at::Tensor& x, int64_t row_dims, int64_t max_k) {
  TORCH_CHECK_VALUE(is_quant_dtype(x.scalar_type()),
                    "mesa: row_exponents supports float32, float16 and bfloat16 inputs, got ", x.scalar_type());
  TORCH_CHECK_VALUE(row_dims >= 1 && row_dims <= x.dim(), "mesa: row_exponents: row_dims must be in [1, ", x.dim(),
                    "] for a ", x.dim(), "-d tensor, got ", row_dims);
  TORCH_CHECK_VALUE(max_k >= 0 && max_k <= 126, "mesa: row_exponents: max_k must be in [0, 126], got ", max_k);
  int64_t L = 1;
  for (int64_t d = x.dim() - row_dims; d < x.dim(); ++d) L *= x.size(d);
  return L;
}

Layout check_observe_rows(const at::Tensor& x, const at::Tensor& alpha_est, const at::Tensor& beta_est,
                          const at::Tensor& initialized, const at::Tensor& rng, int64_t dim, int64_t num_groups,
                          double decay, bool per_sample, int64_t row_dims, int64_t max_k) {
  const Layout L = check_observe(x, alpha_est, beta_est, initialized, rng, dim, num_groups, decay, per_sample);
  check_row_exponents(x, row_dims, max_k);
  return L;
}

bool rows_as_cells(const Layout& L, int64_t ndim, int64_t row_dims) {
  return L.numel > 0 && ndim >= 2 && row_dims == 1 && L.dim == ndim - 1;
}

std::vector<int64_t> last_dim_rows_shape(at::IntArrayRef x_sizes) {
  std::vector<int64_t> shape(x_sizes.begin(), x_sizes.end());
  shape.back() = 1;
  return shape;
}

std::vector<int64_t> cells_shape(at::IntArrayRef x_sizes, int64_t G) {
  std::vector<int64_t> shape(x_sizes.begin(), x_sizes.end() - 1);
  shape.push_back(2);
  shape.push_back(G);
  return shape;
}

}  // namespace mesa

TORCH_LIBRARY(mesa, m) {
  // Fake (meta) implementations and autograd live in this Python module.
  m.set_python_module("mesa_train.quant");
  // flexible_layout (group_minmax, observe, delayed_observe): Inductor may hand x over in any
  // layout (the CPU ops copy it, the CUDA kernels read strided x in place). Its default for a
  // custom op, the eager strides exactly, made it copy the traced min/max cells, which it lays
  // out with padded rows (197 x 6 floats -> 1184), into a contiguous buffer: one kernel more
  // for each of 3 compressions of a DeiT-S block.
  const std::vector<at::Tag> flexible = {at::Tag::flexible_layout};
  m.def("group_minmax(Tensor x, int dim, int num_groups, bool per_sample) -> (Tensor min, Tensor max)", flexible);
  // seed: int64 (2,) = [lo, hi] (uint32 each) on x's device, read by the kernel (no host sync)
  // row_exp (optional, int8, one per row of the last dims: check_row_exp): x's rows are taken
  // as x * 2**k (rounded to x's dtype) and dequantize's as y * 2**-k (rounded to dtype), the
  // power-of-two row scales of mesa_train.nn.rowscale inside the kernels (no scaled copy).
  // row_mean / row_rstd (optional, float32, one per row: check_row_norm): x is taken as
  // x_hat = (x - mean) * rstd in float32 (normalized_rows), then scaled by 2**k in float32: a
  // LayerNorm's normalised input, not written to memory on CUDA (observe_rows takes them too).
  // row_mul (optional, float32, one per row: check_row_mul): dequantize's output then times
  // it, in float32, rounded to dtype (LayerNorm's backward: 1 / rstd, so x - mean comes back)
  // col_scale / col_shift (optional, float32, (C,) for the last dim's C columns: check_cols):
  // the values made as for dtype float32 (row_exp, row_mul included), times col_scale, then
  // plus col_shift (two float32 roundings, never fused), then rounded to dtype: a LayerNorm's
  // output x_hat * gamma + beta rebuilt from x_hat's codes in one pass (DESIGN.md, "LayerNorm
  // + Linear: one copy"; was a dequantize, a multiply, an add and a cast, 27 bytes an element)
  m.def(
      "quantize(Tensor x, Tensor alpha, Tensor beta, int dim, int num_groups, bool stochastic, Tensor seed, "
      "Tensor? row_exp=None, Tensor? row_mean=None, Tensor? row_rstd=None) -> Tensor");
  m.def(
      "dequantize(Tensor q, Tensor alpha, Tensor beta, int dim, int num_groups, ScalarType dtype, "
      "Tensor? row_exp=None, Tensor? row_mul=None, Tensor? col_scale=None, Tensor? col_shift=None) -> Tensor");
  // int8 k = clamp(floor(log2(mean_row_absmax / row_absmax)), 0, max_k) per row of the last
  // row_dims dims, shape x.shape[:-row_dims] + (1,) * row_dims (mesa_train.nn.rowscale)
  m.def("row_exponents(Tensor x, int row_dims, int max_k) -> Tensor");
  // One launch for the whole running-estimate update (instead of ~20 small torch ops):
  // mutates the first G entries of the estimate buffers and `initialized` in place and
  // returns fresh (S, G) alpha/beta for this batch.
  m.def(
      "update_estimates(Tensor min, Tensor max, Tensor(a!) alpha_est, Tensor(b!) beta_est, Tensor(c!) initialized, "
      "float decay, bool per_sample, bool symmetric, bool valid) -> (Tensor alpha, Tensor beta)");
  // update_estimates + the seed step in one op (one launch on CUDA): observe without the
  // min/max pass. The traced compression under torch.compile calls it after a traced
  // group_minmax: the per-group bookkeeping (about 150 small ops traced) stays one graph
  // node, while the passes over the activation stay visible to Inductor.
  m.def(
      "estimate_and_seed(Tensor min, Tensor max, Tensor(a!) alpha_est, Tensor(b!) beta_est, "
      "Tensor(c!) initialized, Tensor(d!) rng, float decay, bool per_sample, bool symmetric, bool valid) -> "
      "(Tensor alpha, Tensor beta, Tensor seed)");
  // group_minmax + update_estimates (valid = numel > 0) + the seed step in one op (one
  // launch on CUDA): returns this batch's (S, G) alpha/beta and a fresh quantize seed,
  // advances rng = [key, counter] in place (DESIGN.md, "Seed step").
  m.def(
      "observe(Tensor x, Tensor(a!) alpha_est, Tensor(b!) beta_est, Tensor(c!) initialized, Tensor(d!) rng, "
      "int dim, int num_groups, float decay, bool per_sample, bool symmetric, Tensor? row_exp=None) -> "
      "(Tensor alpha, Tensor beta, Tensor seed)",
      flexible);
  // row_exponents(x, row_dims, max_k), then observe(x, ..., row_exp=k), as one op that also
  // returns k (DESIGN.md, "observe_rows"): with groups and rows over the last dim, one pass
  // over x finds both the row maxima and each row's per-group min/max, so a compression with
  // row scales reads x twice (this op, quantize) instead of three times.
  m.def(
      "observe_rows(Tensor x, Tensor(a!) alpha_est, Tensor(b!) beta_est, Tensor(c!) initialized, Tensor(d!) rng, "
      "int dim, int num_groups, float decay, bool per_sample, bool symmetric, int row_dims, int max_k, "
      "Tensor? row_mean=None, Tensor? row_rstd=None) -> (Tensor alpha, Tensor beta, Tensor seed, Tensor row_exp)");
  // estimator "delayed" (DESIGN.md, "Delayed estimates"): quantize with the running estimates
  // as they stand (initialized: after a first batch through observe), then this batch's
  // min/max update them, in one pass over x (one launch on CUDA). Returns the codes and the
  // (1, G) alpha/beta they were made with; the seed is the one observe would draw (same rng step).
  m.def(
      "quantize_observe(Tensor x, Tensor(a!) alpha_est, Tensor(b!) beta_est, Tensor(c!) initialized, "
      "Tensor(d!) rng, int dim, int num_groups, float decay, bool symmetric, bool stochastic, "
      "Tensor? row_exp=None) -> (Tensor q, Tensor alpha, Tensor beta)");
  // The seed the seed step would draw from rng = [key, counter] now, rng left alone (pure):
  // the traced delayed compression codes with it, then delayed_observe advances the counter.
  // An op, not traced arithmetic: Inductor inlines pointwise producers into every use, and the
  // three chained lowbias32 hashes, each using its input twice, grew exponentially when
  // lowered (a DeiT-S block had not compiled after 23 minutes on 2 CPU cores).
  m.def("seed_of(Tensor rng) -> Tensor");
  // quantize_observe's second half with initialized estimates, for the traced delayed
  // compression (which codes x with the buffers and the seed the rng gives now): returns
  // (1, G) copies of the estimates as they stand, then x's min/max update them and the rng
  // counter advances by one (one launch on CUDA). x may be x's row-segment min/max cells.
  m.def(
      "delayed_observe(Tensor x, Tensor(a!) alpha_est, Tensor(b!) beta_est, Tensor(c!) initialized, "
      "Tensor(d!) rng, int dim, int num_groups, float decay, bool symmetric) -> (Tensor alpha, Tensor beta)",
      flexible);
  // The backward of a softmax over the last dim straight from its codes (DESIGN.md, "Fused
  // softmax backward"): one pass instead of dequantize, renormalise and _softmax_backward_data.
  // The group dim must not be the last one (one (alpha, beta) per row); returns g's dtype.
  // y_dtype: the dtype the map is dequantized through (None: g's; else float32): a float32
  // map whose gradient and input are bf16 / f16 (CUDA autocast) needs no cast around the op;
  // out_dtype: the result's (None: g's; float32 with a float32 map: float32 logits, Swin's).
  m.def(
      "softmax_backward(Tensor g, Tensor q, Tensor alpha, Tensor beta, int dim, int num_groups, "
      "ScalarType? y_dtype=None, ScalarType? out_dtype=None) -> Tensor");
  // The backward of the exact (erf) GELU at its dequantized input (DESIGN.md, "GELU backward
  // from the codes"): aten::gelu_backward(g, dequantize(q, ..., g.dtype)); one pass on CUDA
  // (the dequantized input never reaches memory), the composition itself on the CPU.
  // row_exp: the codes' power-of-two row scales (GELU + Linear: h is fc2's input), undone first
  m.def(
      "gelu_backward(Tensor g, Tensor q, Tensor alpha, Tensor beta, int dim, int num_groups, "
      "Tensor? row_exp=None) -> Tensor");
  // (dequantize_gelu(q, ..., g.dtype, row_exp), gelu_backward(g, q, ..., row_exp)) from one read
  // of the codes (GELU + Linear's backward: fc2's input and the GELU's gradient); one pass on
  // CUDA with one erf per element, the composition on the CPU
  m.def(
      "gelu_value_and_grad(Tensor g, Tensor q, Tensor alpha, Tensor beta, int dim, int num_groups, "
      "Tensor? row_exp=None) -> (Tensor value, Tensor dx)");
  // aten::gelu(dequantize(q, ..., dtype, row_exp)): the exact GELU of the dequantized input in
  // one pass on CUDA (GELU + Linear's backward recomputes fc2's input from h's codes; DESIGN.md,
  // "MLP: one copy for GELU and fc2"), the composition itself on the CPU
  // A LayerNorm's (dx, dweight, dbias) over the last dim from its output gradient g and the
  // codes q of its normalised input x_hat (groups along the last dim, row_exp their row
  // scales), rstd per row and weight (None: no affine weight), all float32 (DESIGN.md,
  // "LayerNorm backward from the codes"): one pass instead of dequantize + cast +
  // native_layer_norm_backward; rows of at most 1024. dparams is (2, D): dweight, then dbias,
  // the rows of one sum over their partials (one reduction launch where two took 20 us each
  // on an H100; two outputs cannot share one reduction's storage).
  m.def(
      "layer_norm_backward(Tensor g, Tensor q, Tensor alpha, Tensor beta, int num_groups, Tensor rstd, "
      "Tensor? weight=None, Tensor? row_exp=None) -> (Tensor dx, Tensor dparams)");
  m.def(
      "dequantize_gelu(Tensor q, Tensor alpha, Tensor beta, int dim, int num_groups, ScalarType dtype, "
      "Tensor? row_exp=None) -> Tensor");
  // Variants (DESIGN.md, "Variants"): `bits` in {8, 4, 2} codes packed 8/bits per byte along
  // the flat index (little end first, last byte zero-padded), optional power-of-two steps.
  // Output: 1-d uint8 of ceil(numel * bits / 8) bytes.
  m.def(
      "quantize_bits(Tensor x, Tensor alpha, Tensor beta, int dim, int num_groups, int bits, bool pow2, "
      "bool stochastic, Tensor seed) -> Tensor");
  m.def(
      "dequantize_bits(Tensor q, Tensor alpha, Tensor beta, int[] shape, int dim, int num_groups, int bits, "
      "bool pow2, ScalarType dtype) -> Tensor");
}
