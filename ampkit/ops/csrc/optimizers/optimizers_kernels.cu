// CUDA kernels of the fused optimizers. The per-element math is optimizer_math.h and the hyper-parameters
// come from hyper.h, the code the CPU kernels run and the CPU tests check; only the grid-stride loops, the
// GradScaler prologue (skip on found_inf, unscale by grad_scale) and the launches are CUDA-only.
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include "optimizers/hyper.h"
#include "optimizers/kernel_common.cuh"
#include "optimizers/optimizers_cuda.h"

namespace ampkit {
namespace optim {
namespace cuda {
namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 4096 ? (blocks > 0 ? blocks : 1) : 4096);
}

#define AMPKIT_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(blockDim.x) * gridDim.x)

template <typename param_t, typename grad_t, typename acc_t, bool ADAMW, bool AMSGRAD>
__global__ void adam_kernel(ParamSlot<param_t, acc_t> p, grad_t* grad, acc_t* m, acc_t* v, acc_t* vmax, int64_t n,
                            AdamArgs a, const float* step, ScalerPtrs scaler) {
  if (skipped(scaler)) return;
  const AdamHyper<acc_t> h =
      adam_hyper<acc_t>(static_cast<double>(*step) + 1.0, a.lr, a.beta1, a.beta2, a.eps, a.weight_decay,
                        a.bias_correction, unscaled_factor(a.grad_factor, scaler));
  const acc_t scale = write_back_scale<acc_t>(scaler);
  AMPKIT_GRID_STRIDE(i, n) {
    acc_t value = load_param(p, i);
    acc_t vm = AMSGRAD ? vmax[i] : acc_t(0);
    const acc_t g = static_cast<acc_t>(grad[i]);
    adam_element<acc_t, ADAMW, AMSGRAD>(value, g, m[i], v[i], vm, h);
    if (AMSGRAD) vmax[i] = vm;
    store_param(p, i, value);
    write_unscaled(grad, i, g, scale);
  }
}

template <typename param_t, typename grad_t, typename acc_t, bool MOMENTUM, bool NESTEROV, bool FIRST>
__global__ void sgd_kernel(ParamSlot<param_t, acc_t> p, grad_t* grad, acc_t* buf, int64_t n, SGDHyper<acc_t> h,
                           double grad_factor, ScalerPtrs scaler) {
  if (skipped(scaler)) return;
  h.grad_factor = static_cast<acc_t>(unscaled_factor(grad_factor, scaler));
  const acc_t scale = write_back_scale<acc_t>(scaler);
  AMPKIT_GRID_STRIDE(i, n) {
    acc_t value = load_param(p, i);
    acc_t b = MOMENTUM ? buf[i] : acc_t(0);
    const acc_t g = static_cast<acc_t>(grad[i]);
    sgd_element<acc_t, MOMENTUM, NESTEROV, FIRST>(value, g, b, h);
    if (MOMENTUM) buf[i] = b;
    store_param(p, i, value);
    write_unscaled(grad, i, g, scale);
  }
}

template <typename param_t, typename grad_t, typename acc_t>
__global__ void adagrad_kernel(ParamSlot<param_t, acc_t> p, grad_t* grad, acc_t* sum, int64_t n, AdagradArgs a,
                               const float* step, ScalerPtrs scaler) {
  if (skipped(scaler)) return;
  const double clr = adagrad_clr(static_cast<double>(*step) + 1.0, a.lr, a.lr_decay);
  const AdagradHyper<acc_t> h =
      adagrad_hyper<acc_t>(clr, a.weight_decay, a.eps, unscaled_factor(a.grad_factor, scaler));
  const acc_t scale = write_back_scale<acc_t>(scaler);
  AMPKIT_GRID_STRIDE(i, n) {
    acc_t value = load_param(p, i);
    const acc_t g = static_cast<acc_t>(grad[i]);
    adagrad_element<acc_t>(value, g, sum[i], h);
    store_param(p, i, value);
    write_unscaled(grad, i, g, scale);
  }
}

template <typename param_t, typename grad_t, typename acc_t, bool CENTERED, bool MOMENTUM>
__global__ void rmsprop_kernel(ParamSlot<param_t, acc_t> p, grad_t* grad, acc_t* sq, acc_t* ga, acc_t* buf, int64_t n,
                               RMSpropHyper<acc_t> h, double grad_factor, ScalerPtrs scaler) {
  if (skipped(scaler)) return;
  h.grad_factor = static_cast<acc_t>(unscaled_factor(grad_factor, scaler));
  const acc_t scale = write_back_scale<acc_t>(scaler);
  AMPKIT_GRID_STRIDE(i, n) {
    acc_t value = load_param(p, i);
    acc_t a = CENTERED ? ga[i] : acc_t(0);
    acc_t b = MOMENTUM ? buf[i] : acc_t(0);
    const acc_t g = static_cast<acc_t>(grad[i]);
    rmsprop_element<acc_t, CENTERED, MOMENTUM>(value, g, sq[i], a, b, h);
    if (CENTERED) ga[i] = a;
    if (MOMENTUM) buf[i] = b;
    store_param(p, i, value);
    write_unscaled(grad, i, g, scale);
  }
}

template <typename param_t, typename grad_t, typename acc_t, bool CENTERED, bool MOMENTUM, bool LR_IN_MOMENTUM>
__global__ void rmsprop_tf_kernel(ParamSlot<param_t, acc_t> p, grad_t* grad, acc_t* sq, acc_t* ga, acc_t* buf,
                                  int64_t n, RMSpropTFHyper<acc_t> h, double grad_factor, ScalerPtrs scaler) {
  if (skipped(scaler)) return;
  h.grad_factor = static_cast<acc_t>(unscaled_factor(grad_factor, scaler));
  const acc_t scale = write_back_scale<acc_t>(scaler);
  AMPKIT_GRID_STRIDE(i, n) {
    acc_t value = load_param(p, i);
    acc_t a = CENTERED ? ga[i] : acc_t(0);
    acc_t b = MOMENTUM ? buf[i] : acc_t(0);
    const acc_t g = static_cast<acc_t>(grad[i]);
    rmsprop_tf_element<acc_t, CENTERED, MOMENTUM, LR_IN_MOMENTUM>(value, g, sq[i], a, b, h);
    if (CENTERED) ga[i] = a;
    if (MOMENTUM) buf[i] = b;
    store_param(p, i, value);
    write_unscaled(grad, i, g, scale);
  }
}

template <typename param_t, typename grad_t, typename acc_t>
__global__ void adadelta_kernel(ParamSlot<param_t, acc_t> p, grad_t* grad, acc_t* sq, acc_t* ad, int64_t n,
                                AdadeltaHyper<acc_t> h, double grad_factor, ScalerPtrs scaler) {
  if (skipped(scaler)) return;
  h.grad_factor = static_cast<acc_t>(unscaled_factor(grad_factor, scaler));
  const acc_t scale = write_back_scale<acc_t>(scaler);
  AMPKIT_GRID_STRIDE(i, n) {
    acc_t value = load_param(p, i);
    const acc_t g = static_cast<acc_t>(grad[i]);
    adadelta_element<acc_t>(value, g, sq[i], ad[i], h);
    store_param(p, i, value);
    write_unscaled(grad, i, g, scale);
  }
}

// One thread per counter: kernels launched before it on the stream have read the old values.
constexpr int kStepsPerLaunch = 64;

struct StepPtrs {
  float* step[kStepsPerLaunch];
  int n;
};

__global__ void bump_steps_kernel(StepPtrs steps, const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  if (static_cast<int>(threadIdx.x) < steps.n) *steps.step[threadIdx.x] += 1.0f;
}

template <typename param_t, typename grad_t, typename acc_t, bool ADAMW>
__global__ void lamb_stage1_kernel(const param_t* param, const acc_t* master, const grad_t* grad, acc_t* m,
                                   acc_t* v, acc_t* update, int64_t n, LambHyper<acc_t> h) {
  AMPKIT_GRID_STRIDE(i, n) {
    const acc_t value = master != nullptr ? master[i] : static_cast<acc_t>(param[i]);
    lamb_stage1_element<acc_t, ADAMW>(value, static_cast<acc_t>(grad[i]), m[i], v[i], update[i], h);
  }
}

template <typename param_t, typename acc_t>
__global__ void lamb_stage2_kernel(ParamSlot<param_t, acc_t> p, const acc_t* update, int64_t n, acc_t ratio) {
  AMPKIT_GRID_STRIDE(i, n) { store_param(p, i, load_param(p, i) - ratio * update[i]); }
}

template <typename param_t, typename grad_t, typename acc_t, bool REG_OUTSIDE_MOMENT>
__global__ void novograd_kernel(ParamSlot<param_t, acc_t> p, const grad_t* grad, acc_t* m, int64_t n,
                                NovoGradHyper<acc_t> h) {
  AMPKIT_GRID_STRIDE(i, n) {
    acc_t value = load_param(p, i);
    novograd_element<acc_t, REG_OUTSIDE_MOMENT>(value, static_cast<acc_t>(grad[i]), m[i], h);
    store_param(p, i, value);
  }
}

// Sum of `x` over the block, valid in thread 0 (blockDim.x a multiple of 32, at most 1024).
__device__ inline double block_sum(double x) {
  __shared__ double warp_sums[32];
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_down_sync(0xffffffffu, x, offset);
  __syncthreads();  // a previous call's readers are done with warp_sums
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = x;
  __syncthreads();
  x = threadIdx.x < (blockDim.x >> 5) ? warp_sums[threadIdx.x & 31] : 0.0;
  if (threadIdx.x < 32) {
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_down_sync(0xffffffffu, x, offset);
  }
  return x;
}

// Maximum of `x` (>= 0, NaN winning) over the block, valid in thread 0.
__device__ inline double block_max_cosine(double x) {
  __shared__ double warp_maxes[32];
  for (int offset = 16; offset > 0; offset >>= 1) x = adamp_max_cosine(x, __shfl_down_sync(0xffffffffu, x, offset));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) warp_maxes[threadIdx.x >> 5] = x;
  __syncthreads();
  x = threadIdx.x < (blockDim.x >> 5) ? warp_maxes[threadIdx.x & 31] : 0.0;
  if (threadIdx.x < 32) {
    for (int offset = 16; offset > 0; offset >>= 1) x = adamp_max_cosine(x, __shfl_down_sync(0xffffffffu, x, offset));
  }
  return x;
}

// AdamP pass 1: block b covers chunk (b % chunks) of row (b / chunks); it updates the moments and adds its partial
// sums (grad.weight, grad.grad, weight.weight, weight.direction) into sums[4 * row ...].
template <typename param_t, typename grad_t, typename acc_t, bool NESTEROV>
__global__ void adamp_moments_kernel(ParamSlot<param_t, acc_t> p, const grad_t* grad, acc_t* m, acc_t* v,
                                     int64_t cols, int64_t chunks, AdamPHyper<acc_t> h, double* sums) {
  const int64_t row = blockIdx.x / chunks;
  const int64_t chunk = blockIdx.x % chunks;
  const int64_t chunk_len = (cols + chunks - 1) / chunks;
  const int64_t begin = row * cols + chunk * chunk_len;
  const int64_t end = row * cols + (cols < (chunk + 1) * chunk_len ? cols : (chunk + 1) * chunk_len);
  double gp = 0.0, gg = 0.0, pp = 0.0, pq = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const acc_t g = static_cast<acc_t>(grad[i]) * h.grad_factor;
    const acc_t w = load_param(p, i);
    const acc_t q = adamp_moments<acc_t, NESTEROV>(g, m[i], v[i], h);
    gp += static_cast<double>(g) * static_cast<double>(w);
    gg += static_cast<double>(g) * static_cast<double>(g);
    pp += static_cast<double>(w) * static_cast<double>(w);
    pq += static_cast<double>(w) * static_cast<double>(q);
  }
  const double partial[4] = {block_sum(gp), block_sum(gg), block_sum(pp), block_sum(pq)};
  if (threadIdx.x == 0) {
    for (int k = 0; k < 4; ++k) atomicAdd(sums + 4 * row + k, partial[k]);
  }
}

// AdamP's choice (one block): channel-wise if every row's |cos| is under delta / sqrt(cols), else layer-wise under
// delta / sqrt(numel), else none; writes each row's coefficient and the decay factor.
__global__ void adamp_choose_kernel(const double* sums, int64_t rows, int64_t cols, AdamPProjection o, double* coefs,
                                    double* decay) {
  double max_cos = 0.0, gp = 0.0, gg = 0.0, pp = 0.0, pq = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    const double* s = sums + 4 * r;
    max_cos = adamp_max_cosine(max_cos, adamp_abs_cosine(s[0], s[1], s[2], o.eps));
    gp += s[0];
    gg += s[1];
    pp += s[2];
    pq += s[3];
  }
  max_cos = block_max_cosine(max_cos);
  gp = block_sum(gp);
  gg = block_sum(gg);
  pp = block_sum(pp);
  pq = block_sum(pq);
  __shared__ int choice;  // 0 none, 1 channel-wise, 2 layer-wise
  __shared__ double layer_coef;
  if (threadIdx.x == 0) {
    choice = adamp_choice(max_cos, gp, gg, pp, static_cast<double>(rows), static_cast<double>(cols), o.delta, o.eps);
    layer_coef = adamp_radial_coef(pq, pp, o.eps);
    *decay = 1.0 - o.lr_wd * (choice != 0 ? o.wd_ratio : 1.0);
  }
  __syncthreads();
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    coefs[r] = choice == 1 ? adamp_radial_coef(sums[4 * r + 3], sums[4 * r + 2], o.eps) : choice == 2 ? layer_coef : 0.0;
  }
}

// AdamP pass 2: the direction again from the stored moments, minus its radial part, applied after the decay.
template <typename param_t, typename grad_t, typename acc_t, bool NESTEROV>
__global__ void adamp_apply_kernel(ParamSlot<param_t, acc_t> p, const grad_t* grad, const acc_t* m, const acc_t* v,
                                   int64_t n, int64_t cols, AdamPHyper<acc_t> h, const double* coefs,
                                   const double* decay) {
  const acc_t decay_factor = static_cast<acc_t>(*decay);
  AMPKIT_GRID_STRIDE(i, n) {
    acc_t w = load_param(p, i);
    const acc_t g = static_cast<acc_t>(grad[i]) * h.grad_factor;
    const acc_t q = adamp_direction<acc_t, NESTEROV>(g, m[i], v[i], h);
    adamp_apply<acc_t>(w, q, static_cast<acc_t>(coefs[i / cols]), decay_factor, h);
    store_param(p, i, w);
  }
}

// AdamP on a vector or scalar: one pass, never projected.
template <typename param_t, typename grad_t, typename acc_t, bool NESTEROV>
__global__ void adamp_unprojected_kernel(ParamSlot<param_t, acc_t> p, const grad_t* grad, acc_t* m, acc_t* v,
                                         int64_t n, AdamPHyper<acc_t> h, acc_t decay_factor) {
  AMPKIT_GRID_STRIDE(i, n) {
    acc_t w = load_param(p, i);
    const acc_t g = static_cast<acc_t>(grad[i]) * h.grad_factor;
    adamp_apply<acc_t>(w, adamp_moments<acc_t, NESTEROV>(g, m[i], v[i], h), acc_t(0), decay_factor, h);
    store_param(p, i, w);
  }
}

}  // namespace

template <typename param_t, typename grad_t, typename acc_t>
void launch_adamp(ParamSlot<param_t, acc_t> p, const grad_t* grad, acc_t* exp_avg, acc_t* exp_avg_sq, int64_t rows,
                  int64_t cols, const AdamPHyper<acc_t>& h, const AdamPProjection& projection, bool nesterov,
                  double* scratch, cudaStream_t stream) {
  AMPKIT_BOOL_SWITCH(nesterov, NEST, {
    if (rows == 0) {
      const acc_t decay = static_cast<acc_t>(1.0 - projection.lr_wd);
      adamp_unprojected_kernel<param_t, grad_t, acc_t, NEST>
          <<<blocks_for(cols), kThreads, 0, stream>>>(p, grad, exp_avg, exp_avg_sq, cols, h, decay);
    } else {
      // Chunks of at least 4096 elements per block, enough blocks to fill the GPU when rows are few.
      const int64_t chunks = cols / 4096 > 1 ? (cols / 4096 < 1024 ? cols / 4096 : 1024) : 1;
      double* sums = scratch;
      double* coefs = scratch + 4 * rows;
      double* decay = coefs + rows;
      adamp_moments_kernel<param_t, grad_t, acc_t, NEST><<<static_cast<unsigned>(rows * chunks), kThreads, 0, stream>>>(
          p, grad, exp_avg, exp_avg_sq, cols, chunks, h, sums);
      check_launch("adamp_step (moments)");
      adamp_choose_kernel<<<1, kThreads, 0, stream>>>(sums, rows, cols, projection, coefs, decay);
      check_launch("adamp_step (projection)");
      adamp_apply_kernel<param_t, grad_t, acc_t, NEST><<<blocks_for(rows * cols), kThreads, 0, stream>>>(
          p, grad, exp_avg, exp_avg_sq, rows * cols, cols, h, coefs, decay);
    }
  });
  check_launch("adamp_step");
}

template <typename param_t, typename grad_t, typename acc_t>
void launch_adam(ParamSlot<param_t, acc_t> p, grad_t* grad, acc_t* exp_avg, acc_t* exp_avg_sq, acc_t* max_exp_avg_sq,
                 int64_t n, const AdamArgs& args, const float* step, ScalerPtrs scaler, bool adam_w_mode,
                 cudaStream_t stream) {
  const bool amsgrad = max_exp_avg_sq != nullptr;
  AMPKIT_BOOL_SWITCH(adam_w_mode, ADAMW, AMPKIT_BOOL_SWITCH(amsgrad, AMS, {
    adam_kernel<param_t, grad_t, acc_t, ADAMW, AMS><<<blocks_for(n), kThreads, 0, stream>>>(
        p, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, n, args, step, scaler);
  }));
  check_launch("adam_step");
}

template <typename param_t, typename grad_t, typename acc_t>
void launch_sgd(ParamSlot<param_t, acc_t> p, grad_t* grad, acc_t* momentum_buffer, int64_t n,
                const SGDHyper<acc_t>& h, double grad_factor, ScalerPtrs scaler, bool nesterov, bool first_step,
                cudaStream_t stream) {
  const bool momentum = momentum_buffer != nullptr;
  AMPKIT_BOOL_SWITCH(momentum, MOM, AMPKIT_BOOL_SWITCH(nesterov, NEST, AMPKIT_BOOL_SWITCH(first_step, FIRST, {
    sgd_kernel<param_t, grad_t, acc_t, MOM, NEST, FIRST>
        <<<blocks_for(n), kThreads, 0, stream>>>(p, grad, momentum_buffer, n, h, grad_factor, scaler);
  })));
  check_launch("sgd_step");
}

template <typename param_t, typename grad_t, typename acc_t>
void launch_adagrad(ParamSlot<param_t, acc_t> p, grad_t* grad, acc_t* state_sum, int64_t n, const AdagradArgs& args,
                    const float* step, ScalerPtrs scaler, cudaStream_t stream) {
  adagrad_kernel<param_t, grad_t, acc_t>
      <<<blocks_for(n), kThreads, 0, stream>>>(p, grad, state_sum, n, args, step, scaler);
  check_launch("adagrad_step");
}

template <typename param_t, typename grad_t, typename acc_t>
void launch_rmsprop(ParamSlot<param_t, acc_t> p, grad_t* grad, acc_t* square_avg, acc_t* grad_avg,
                    acc_t* momentum_buffer, int64_t n, const RMSpropHyper<acc_t>& h, double grad_factor,
                    ScalerPtrs scaler, cudaStream_t stream) {
  AMPKIT_BOOL_SWITCH(grad_avg != nullptr, CEN, AMPKIT_BOOL_SWITCH(momentum_buffer != nullptr, MOM, {
    rmsprop_kernel<param_t, grad_t, acc_t, CEN, MOM><<<blocks_for(n), kThreads, 0, stream>>>(
        p, grad, square_avg, grad_avg, momentum_buffer, n, h, grad_factor, scaler);
  }));
  check_launch("rmsprop_step");
}

template <typename param_t, typename grad_t, typename acc_t>
void launch_rmsprop_tf(ParamSlot<param_t, acc_t> p, grad_t* grad, acc_t* square_avg, acc_t* grad_avg,
                       acc_t* momentum_buffer, int64_t n, const RMSpropTFHyper<acc_t>& h, double grad_factor,
                       ScalerPtrs scaler, bool lr_in_momentum, cudaStream_t stream) {
  AMPKIT_BOOL_SWITCH(grad_avg != nullptr, CEN, AMPKIT_BOOL_SWITCH(momentum_buffer != nullptr, MOM,
    AMPKIT_BOOL_SWITCH(lr_in_momentum, LIM, {
      rmsprop_tf_kernel<param_t, grad_t, acc_t, CEN, MOM, LIM><<<blocks_for(n), kThreads, 0, stream>>>(
          p, grad, square_avg, grad_avg, momentum_buffer, n, h, grad_factor, scaler);
    })));
  check_launch("rmsprop_tf_step");
}

template <typename param_t, typename grad_t, typename acc_t>
void launch_adadelta(ParamSlot<param_t, acc_t> p, grad_t* grad, acc_t* square_avg, acc_t* acc_delta, int64_t n,
                     const AdadeltaHyper<acc_t>& h, double grad_factor, ScalerPtrs scaler, cudaStream_t stream) {
  adadelta_kernel<param_t, grad_t, acc_t>
      <<<blocks_for(n), kThreads, 0, stream>>>(p, grad, square_avg, acc_delta, n, h, grad_factor, scaler);
  check_launch("adadelta_step");
}

void launch_bump_steps(float* const* steps, int64_t n, const float* found_inf, cudaStream_t stream) {
  for (int64_t begin = 0; begin < n; begin += kStepsPerLaunch) {
    StepPtrs list{};
    list.n = static_cast<int>(n - begin < kStepsPerLaunch ? n - begin : kStepsPerLaunch);
    for (int i = 0; i < list.n; ++i) list.step[i] = steps[begin + i];
    bump_steps_kernel<<<1, kStepsPerLaunch, 0, stream>>>(list, found_inf);
    check_launch("step counters");
  }
}

template <typename param_t, typename grad_t, typename acc_t>
void launch_lamb_stage1(const param_t* param, const acc_t* master, const grad_t* grad, acc_t* exp_avg,
                        acc_t* exp_avg_sq, acc_t* update, int64_t n, const LambHyper<acc_t>& h, bool adam_w_mode,
                        cudaStream_t stream) {
  AMPKIT_BOOL_SWITCH(adam_w_mode, ADAMW, {
    lamb_stage1_kernel<param_t, grad_t, acc_t, ADAMW>
        <<<blocks_for(n), kThreads, 0, stream>>>(param, master, grad, exp_avg, exp_avg_sq, update, n, h);
  });
  check_launch("lamb_stage1");
}

template <typename param_t, typename acc_t>
void launch_lamb_stage2(ParamSlot<param_t, acc_t> p, const acc_t* update, int64_t n, acc_t ratio,
                        cudaStream_t stream) {
  lamb_stage2_kernel<param_t, acc_t><<<blocks_for(n), kThreads, 0, stream>>>(p, update, n, ratio);
  check_launch("lamb_stage2");
}

template <typename param_t, typename grad_t, typename acc_t>
void launch_novograd(ParamSlot<param_t, acc_t> p, const grad_t* grad, acc_t* exp_avg, int64_t n,
                     const NovoGradHyper<acc_t>& h, bool reg_inside_moment, cudaStream_t stream) {
  AMPKIT_BOOL_SWITCH(!reg_inside_moment, OUTSIDE, {
    novograd_kernel<param_t, grad_t, acc_t, OUTSIDE><<<blocks_for(n), kThreads, 0, stream>>>(p, grad, exp_avg, n, h);
  });
  check_launch("novograd_step");
}

// The (param, grad) pairs the CPU kernels accept: fp64/fp64, fp32/fp32, fp16|bf16 with same-type or fp32 grads.
#define AMPKIT_INSTANTIATE(P, G, A)                                                                               \
  template void launch_adam<P, G, A>(ParamSlot<P, A>, G*, A*, A*, A*, int64_t, const AdamArgs&, const float*,       \
                                     ScalerPtrs, bool, cudaStream_t);                                              \
  template void launch_sgd<P, G, A>(ParamSlot<P, A>, G*, A*, int64_t, const SGDHyper<A>&, double, ScalerPtrs, bool, \
                                    bool, cudaStream_t);                                                          \
  template void launch_adagrad<P, G, A>(ParamSlot<P, A>, G*, A*, int64_t, const AdagradArgs&, const float*,         \
                                        ScalerPtrs, cudaStream_t);                                                \
  template void launch_rmsprop<P, G, A>(ParamSlot<P, A>, G*, A*, A*, A*, int64_t, const RMSpropHyper<A>&, double,   \
                                        ScalerPtrs, cudaStream_t);                                                \
  template void launch_rmsprop_tf<P, G, A>(ParamSlot<P, A>, G*, A*, A*, A*, int64_t, const RMSpropTFHyper<A>&,      \
                                           double, ScalerPtrs, bool, cudaStream_t);                               \
  template void launch_adadelta<P, G, A>(ParamSlot<P, A>, G*, A*, A*, int64_t, const AdadeltaHyper<A>&, double,     \
                                         ScalerPtrs, cudaStream_t);                                               \
  template void launch_lamb_stage1<P, G, A>(const P*, const A*, const G*, A*, A*, A*, int64_t,                     \
                                            const LambHyper<A>&, bool, cudaStream_t);                             \
  template void launch_novograd<P, G, A>(ParamSlot<P, A>, const G*, A*, int64_t, const NovoGradHyper<A>&, bool,    \
                                         cudaStream_t);                                                           \
  template void launch_adamp<P, G, A>(ParamSlot<P, A>, const G*, A*, A*, int64_t, int64_t, const AdamPHyper<A>&,    \
                                      const AdamPProjection&, bool, double*, cudaStream_t);

AMPKIT_INSTANTIATE(double, double, double)
AMPKIT_INSTANTIATE(float, float, float)
AMPKIT_INSTANTIATE(c10::Half, c10::Half, float)
AMPKIT_INSTANTIATE(c10::Half, float, float)
AMPKIT_INSTANTIATE(c10::BFloat16, c10::BFloat16, float)
AMPKIT_INSTANTIATE(c10::BFloat16, float, float)

template void launch_lamb_stage2<double, double>(ParamSlot<double, double>, const double*, int64_t, double,
                                                 cudaStream_t);
template void launch_lamb_stage2<float, float>(ParamSlot<float, float>, const float*, int64_t, float, cudaStream_t);
template void launch_lamb_stage2<c10::Half, float>(ParamSlot<c10::Half, float>, const float*, int64_t, float,
                                                   cudaStream_t);
template void launch_lamb_stage2<c10::BFloat16, float>(ParamSlot<c10::BFloat16, float>, const float*, int64_t, float,
                                                       cudaStream_t);

}  // namespace cuda
}  // namespace optim
}  // namespace ampkit
