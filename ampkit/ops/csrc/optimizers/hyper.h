// Construction of the per-element hyper-parameter structs (optimizer_math.h), shared by the CPU and CUDA
// kernels so both derive them identically: every derived value (bias corrections, 1 - beta, decay factors)
// is computed in double, as torch.optim does, then rounded once to the accumulate type. The step-dependent
// ones (Adam's, Adagrad's) also run on the device, where a CUDA kernel reads its step counter.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>

#include "optimizers/optimizer_math.h"

namespace ampkit {
namespace optim {

template <typename acc_t>
C10_HOST_DEVICE inline AdamHyper<acc_t> adam_hyper(double step, double lr, double beta1, double beta2, double eps,
                                                   double weight_decay, bool bias_correction, double grad_factor) {
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, step) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, step) : 1.0;
  return {acc_t(grad_factor),  acc_t(beta1),        acc_t(beta2),     acc_t(1.0 - beta1),
          acc_t(1.0 - beta2),  acc_t(eps),          acc_t(weight_decay), acc_t(1.0 - lr * weight_decay),
          acc_t(lr / bc1),     acc_t(std::sqrt(bc2))};
}

template <typename acc_t>
SGDHyper<acc_t> sgd_hyper(double lr, double weight_decay, double momentum, double dampening, double grad_factor) {
  return {acc_t(grad_factor), acc_t(lr), acc_t(weight_decay), acc_t(momentum), acc_t(1.0 - dampening)};
}

// Adagrad's learning rate decays with the step: clr = lr / (1 + (step - 1) * lr_decay).
C10_HOST_DEVICE inline double adagrad_clr(double step, double lr, double lr_decay) {
  return lr / (1.0 + (step - 1.0) * lr_decay);
}

template <typename acc_t>
C10_HOST_DEVICE inline AdagradHyper<acc_t> adagrad_hyper(double clr, double weight_decay, double eps,
                                                         double grad_factor) {
  return {acc_t(grad_factor), acc_t(clr), acc_t(weight_decay), acc_t(eps)};
}

template <typename acc_t>
RMSpropHyper<acc_t> rmsprop_hyper(double lr, double alpha, double eps, double weight_decay, double momentum,
                                  double grad_factor) {
  return {acc_t(grad_factor), acc_t(lr),           acc_t(alpha),   acc_t(1.0 - alpha),
          acc_t(eps),         acc_t(weight_decay), acc_t(momentum)};
}

template <typename acc_t>
RMSpropTFHyper<acc_t> rmsprop_tf_hyper(double lr, double alpha, double eps, double weight_decay, double momentum,
                                       bool decoupled_decay, double grad_factor) {
  return {acc_t(grad_factor),
          acc_t(lr),
          acc_t(alpha),
          acc_t(1.0 - alpha),
          acc_t(eps),
          acc_t(decoupled_decay ? 0.0 : weight_decay),
          acc_t(decoupled_decay ? 1.0 - lr * weight_decay : 1.0),
          acc_t(momentum)};
}

template <typename acc_t>
AdadeltaHyper<acc_t> adadelta_hyper(double lr, double rho, double eps, double weight_decay, double grad_factor) {
  return {acc_t(grad_factor), acc_t(lr), acc_t(rho), acc_t(1.0 - rho), acc_t(eps), acc_t(weight_decay)};
}

template <typename acc_t>
LambHyper<acc_t> lamb_hyper(double step, double beta1, double beta2, double eps, double weight_decay,
                            bool grad_averaging, bool bias_correction, double grad_factor) {
  return {acc_t(grad_factor),
          acc_t(beta1),
          acc_t(beta2),
          acc_t(grad_averaging ? 1.0 - beta1 : 1.0),
          acc_t(1.0 - beta2),
          acc_t(eps),
          acc_t(weight_decay),
          acc_t(bias_correction ? 1.0 - std::pow(beta1, step) : 1.0),
          acc_t(bias_correction ? 1.0 - std::pow(beta2, step) : 1.0)};
}

template <typename acc_t>
NovoGradHyper<acc_t> novograd_hyper(double denom, double lr, double beta1, double weight_decay, bool grad_averaging,
                                    double bias_correction1, double grad_factor) {
  return {acc_t(grad_factor),     acc_t(lr),           acc_t(beta1), acc_t(grad_averaging ? 1.0 - beta1 : 1.0),
          acc_t(weight_decay),    acc_t(bias_correction1), acc_t(denom)};
}

template <typename acc_t>
AdamPHyper<acc_t> adamp_hyper(double step, double lr, double beta1, double beta2, double eps, double grad_factor) {
  return {acc_t(grad_factor), acc_t(beta1),       acc_t(beta2),
          acc_t(1.0 - beta1), acc_t(1.0 - beta2), acc_t(eps),
          acc_t(lr / (1.0 - std::pow(beta1, step))), acc_t(std::sqrt(1.0 - std::pow(beta2, step)))};
}

}  // namespace optim
}  // namespace ampkit
