// Per-element optimizer math, written once and called by the CPU loops (optimizers_*.cpp) and the CUDA
// kernels (optimizers_kernels.cu). The CPU tests therefore exercise the very arithmetic the GPU runs.
//
// Every functor works in the accumulate type `acc_t` (float for fp32/fp16/bf16 parameters, double for fp64),
// receives the raw gradient and multiplies it by `grad_factor` first: that factor carries the loss-scale
// unscaling, the global-norm clip coefficient and the sign for `maximize`, so no separate pass over the
// gradients is needed.
// The CPU translation units that use these functors are compiled without fused multiply-add contraction
// (a `#pragma GCC optimize("fp-contract=off")` on their first line): torch.optim's CPU kernels round each
// product and sum separately, and matching that keeps 100-step trajectories within ~3e-8 of torch instead
// of ~1e-6 (neither is closer to float64). The kernels are memory-bound, so FMA would buy nothing.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>

namespace ampkit {
namespace optim {

template <typename acc_t>
C10_HOST_DEVICE inline acc_t max_of(acc_t a, acc_t b) {
  // NaN-propagating like torch.maximum.
  return (a != a || a > b) ? a : b;
}

// torch.optim.Adam / AdamW (and Apex FusedAdam) on one element.
template <typename acc_t>
struct AdamHyper {
  acc_t grad_factor;
  acc_t beta1;
  acc_t beta2;
  acc_t one_minus_beta1;  // computed in double on the host, as torch does
  acc_t one_minus_beta2;
  acc_t eps;
  acc_t weight_decay;   // L2 mode: added to the gradient
  acc_t decay_factor;   // AdamW mode: 1 - lr * weight_decay
  acc_t step_size;      // lr / bias_correction1
  acc_t bias_correction2_sqrt;
};

template <typename acc_t, bool ADAMW, bool AMSGRAD>
C10_HOST_DEVICE inline void adam_element(acc_t& p, acc_t g, acc_t& m, acc_t& v, acc_t& vmax,
                                         const AdamHyper<acc_t>& h) {
  g = g * h.grad_factor;
  if (ADAMW) {
    p = p * h.decay_factor;
  } else {
    g = g + h.weight_decay * p;
  }
  m = m + h.one_minus_beta1 * (g - m);
  v = h.beta2 * v + h.one_minus_beta2 * g * g;
  acc_t second = v;
  if (AMSGRAD) {
    vmax = max_of(vmax, v);
    second = vmax;
  }
  const acc_t denom = std::sqrt(second) / h.bias_correction2_sqrt + h.eps;
  p = p - h.step_size * m / denom;
}

// torch.optim.SGD on one element. FIRST: the momentum buffer is initialised with the gradient.
template <typename acc_t>
struct SGDHyper {
  acc_t grad_factor;
  acc_t lr;
  acc_t weight_decay;
  acc_t momentum;
  acc_t one_minus_dampening;
};

template <typename acc_t, bool MOMENTUM, bool NESTEROV, bool FIRST>
C10_HOST_DEVICE inline void sgd_element(acc_t& p, acc_t g, acc_t& buf, const SGDHyper<acc_t>& h) {
  g = g * h.grad_factor + h.weight_decay * p;
  if (MOMENTUM) {
    buf = FIRST ? g : h.momentum * buf + h.one_minus_dampening * g;
    g = NESTEROV ? g + h.momentum * buf : buf;
  }
  p = p - h.lr * g;
}

// torch.optim.Adagrad on one element; clr = lr / (1 + (step - 1) * lr_decay) per tensor.
template <typename acc_t>
struct AdagradHyper {
  acc_t grad_factor;
  acc_t clr;
  acc_t weight_decay;
  acc_t eps;
};

template <typename acc_t>
C10_HOST_DEVICE inline void adagrad_element(acc_t& p, acc_t g, acc_t& sum, const AdagradHyper<acc_t>& h) {
  g = g * h.grad_factor + h.weight_decay * p;
  sum = sum + g * g;
  p = p - h.clr * g / (std::sqrt(sum) + h.eps);
}

// torch.optim.RMSprop on one element (centered and momentum variants).
template <typename acc_t>
struct RMSpropHyper {
  acc_t grad_factor;
  acc_t lr;
  acc_t alpha;
  acc_t one_minus_alpha;
  acc_t eps;
  acc_t weight_decay;
  acc_t momentum;
};

template <typename acc_t, bool CENTERED, bool MOMENTUM>
C10_HOST_DEVICE inline void rmsprop_element(acc_t& p, acc_t g, acc_t& square_avg, acc_t& grad_avg, acc_t& buf,
                                            const RMSpropHyper<acc_t>& h) {
  g = g * h.grad_factor + h.weight_decay * p;
  square_avg = h.alpha * square_avg + h.one_minus_alpha * g * g;
  acc_t avg;
  if (CENTERED) {
    grad_avg = grad_avg + h.one_minus_alpha * (g - grad_avg);
    avg = std::sqrt(square_avg - grad_avg * grad_avg) + h.eps;
  } else {
    avg = std::sqrt(square_avg) + h.eps;
  }
  if (MOMENTUM) {
    buf = h.momentum * buf + g / avg;
    p = p - h.lr * buf;
  } else {
    p = p - h.lr * g / avg;
  }
}

// TensorFlow-style RMSprop (timm's RMSpropTF): eps inside the sqrt, square_avg starts at one,
// optional decoupled weight decay and the learning rate applied inside the momentum buffer.
template <typename acc_t>
struct RMSpropTFHyper {
  acc_t grad_factor;
  acc_t lr;
  acc_t alpha;
  acc_t one_minus_alpha;
  acc_t eps;
  acc_t weight_decay;  // L2 mode: added to the gradient
  acc_t decay_factor;  // decoupled mode: 1 - lr * weight_decay
  acc_t momentum;
};

template <typename acc_t, bool CENTERED, bool MOMENTUM, bool LR_IN_MOMENTUM>
C10_HOST_DEVICE inline void rmsprop_tf_element(acc_t& p, acc_t g, acc_t& square_avg, acc_t& grad_avg,
                                               acc_t& buf, const RMSpropTFHyper<acc_t>& h) {
  p = p * h.decay_factor;
  g = g * h.grad_factor + h.weight_decay * p;
  square_avg = square_avg + h.one_minus_alpha * (g * g - square_avg);
  acc_t avg;
  if (CENTERED) {
    grad_avg = grad_avg + h.one_minus_alpha * (g - grad_avg);
    avg = std::sqrt(square_avg - grad_avg * grad_avg + h.eps);
  } else {
    avg = std::sqrt(square_avg + h.eps);
  }
  if (MOMENTUM) {
    if (LR_IN_MOMENTUM) {
      buf = h.momentum * buf + h.lr * g / avg;
      p = p - buf;
    } else {
      buf = h.momentum * buf + g / avg;
      p = p - h.lr * buf;
    }
  } else {
    p = p - h.lr * g / avg;
  }
}

// torch.optim.Adadelta on one element.
template <typename acc_t>
struct AdadeltaHyper {
  acc_t grad_factor;
  acc_t lr;
  acc_t rho;
  acc_t one_minus_rho;
  acc_t eps;
  acc_t weight_decay;
};

template <typename acc_t>
C10_HOST_DEVICE inline void adadelta_element(acc_t& p, acc_t g, acc_t& square_avg, acc_t& acc_delta,
                                             const AdadeltaHyper<acc_t>& h) {
  g = g * h.grad_factor + h.weight_decay * p;
  square_avg = h.rho * square_avg + h.one_minus_rho * g * g;
  const acc_t delta = std::sqrt(acc_delta + h.eps) / std::sqrt(square_avg + h.eps) * g;
  acc_delta = h.rho * acc_delta + h.one_minus_rho * delta * delta;
  p = p - h.lr * delta;
}

// LAMB stage 1 (Apex multi_tensor_lamb): moments and the raw update direction, written into `update`.
template <typename acc_t>
struct LambHyper {
  acc_t grad_factor;  // unscale x (1 / global clip ratio)
  acc_t beta1;
  acc_t beta2;
  acc_t beta3;  // 1 - beta1 with grad averaging, else 1
  acc_t one_minus_beta2;
  acc_t eps;
  acc_t weight_decay;
  acc_t bias_correction1;
  acc_t bias_correction2;
};

template <typename acc_t, bool ADAMW>
C10_HOST_DEVICE inline void lamb_stage1_element(acc_t p, acc_t g, acc_t& m, acc_t& v, acc_t& update,
                                                const LambHyper<acc_t>& h) {
  g = g * h.grad_factor;
  if (!ADAMW) {
    g = g + h.weight_decay * p;
  }
  m = h.beta1 * m + h.beta3 * g;
  v = h.beta2 * v + h.one_minus_beta2 * g * g;
  update = (m / h.bias_correction1) / (std::sqrt(v / h.bias_correction2) + h.eps);
  if (ADAMW) {
    update = update + h.weight_decay * p;
  }
}

// NovoGrad (Apex FusedNovoGrad, norm_type=2) on one element; `denom` is the per-tensor
// blended gradient norm / sqrt(bias_correction2) + eps, computed before the element loop.
template <typename acc_t>
struct NovoGradHyper {
  acc_t grad_factor;
  acc_t lr;
  acc_t beta1;
  acc_t beta3;  // 1 - beta1 with grad averaging, else 1
  acc_t weight_decay;
  acc_t bias_correction1;
  acc_t denom;  // per tensor
};

// REG_OUTSIDE_MOMENT: Apex moment_mode 1 (the default): weight decay is added to the update, not the moment.
template <typename acc_t, bool REG_OUTSIDE_MOMENT>
C10_HOST_DEVICE inline void novograd_element(acc_t& p, acc_t g, acc_t& m, const NovoGradHyper<acc_t>& h) {
  g = g * h.grad_factor;
  if (REG_OUTSIDE_MOMENT) {
    m = h.beta1 * m + h.beta3 * g;
    p = p - h.lr * ((m / h.bias_correction1) / h.denom + h.weight_decay * p);
  } else {
    g = g / h.denom + h.weight_decay * p;
    m = h.beta1 * m + h.beta3 * g;
    p = p - h.lr * (m / h.bias_correction1);
  }
}

// AdamP (clovaai/AdamP) on one element, split around its per-tensor projection: `adamp_moments` updates the
// moments and returns the Adam direction ("perturb"); once the tensor's sums have chosen a projection
// coefficient per row (`coef`, 0 when none) and the decay factor (1 - lr * weight_decay * ratio),
// `adamp_apply` moves the weight along the direction minus its radial part, coef * p.
template <typename acc_t>
struct AdamPHyper {
  acc_t grad_factor;
  acc_t beta1;
  acc_t beta2;
  acc_t one_minus_beta1;
  acc_t one_minus_beta2;
  acc_t eps;
  acc_t step_size;  // lr / bias_correction1
  acc_t bias_correction2_sqrt;
};

// The direction from updated moments; NESTEROV looks one momentum step ahead.
template <typename acc_t, bool NESTEROV>
C10_HOST_DEVICE inline acc_t adamp_direction(acc_t g, acc_t m, acc_t v, const AdamPHyper<acc_t>& h) {
  const acc_t denom = std::sqrt(v) / h.bias_correction2_sqrt + h.eps;
  const acc_t first = NESTEROV ? h.beta1 * m + h.one_minus_beta1 * g : m;
  return first / denom;
}

// `g` is the factored gradient (grad_factor already applied): the projection test reads it too.
template <typename acc_t, bool NESTEROV>
C10_HOST_DEVICE inline acc_t adamp_moments(acc_t g, acc_t& m, acc_t& v, const AdamPHyper<acc_t>& h) {
  m = m * h.beta1 + h.one_minus_beta1 * g;
  v = v * h.beta2 + h.one_minus_beta2 * g * g;
  return adamp_direction<acc_t, NESTEROV>(g, m, v, h);
}

// The projection test's numbers from a row's (or the tensor's) sums of grad.weight, grad.grad, weight.weight and
// weight.direction. |cos(grad, weight)| as F.cosine_similarity computes it (each norm clamped below at eps):
C10_HOST_DEVICE inline double adamp_abs_cosine(double gp, double gg, double pp, double eps) {
  const double g_norm = std::sqrt(gg) > eps ? std::sqrt(gg) : eps;
  const double p_norm = std::sqrt(pp) > eps ? std::sqrt(pp) : eps;
  return (gp < 0 ? -gp : gp) / (g_norm * p_norm);
}

// The larger of two |cos| values, NaN winning (and staying), as torch's max(): a row with a NaN gradient fails
// the channel-wise test, as it does in the reference.
C10_HOST_DEVICE inline double adamp_max_cosine(double a, double b) { return (b != b || b > a) ? b : a; }

// ... and the radial coefficient: (direction . unit) * unit = weight * pq / (|weight| + eps)^2, with
// unit = weight / (|weight| + eps).
C10_HOST_DEVICE inline double adamp_radial_coef(double pq, double pp, double eps) {
  const double norm = std::sqrt(pp) + eps;
  return pq / (norm * norm);
}

// AdamP's projection, from the largest row |cos| and the whole tensor's sums: 1 channel-wise (every row's |cos|
// under delta / sqrt(cols)), 2 layer-wise (the tensor's under delta / sqrt(numel)), 0 none. The CPU and CUDA
// kernels both decide through it, so they project the same tensors.
C10_HOST_DEVICE inline int adamp_choice(double max_cos, double gp, double gg, double pp, double rows, double cols,
                                        double delta, double eps) {
  if (max_cos < delta / std::sqrt(cols)) return 1;
  if (adamp_abs_cosine(gp, gg, pp, eps) < delta / std::sqrt(rows * cols)) return 2;
  return 0;
}

template <typename acc_t>
C10_HOST_DEVICE inline void adamp_apply(acc_t& p, acc_t perturb, acc_t coef, acc_t decay_factor,
                                        const AdamPHyper<acc_t>& h) {
  perturb = perturb - coef * p;
  p = p * decay_factor;
  p = p - h.step_size * perturb;
}

}  // namespace optim
}  // namespace ampkit
