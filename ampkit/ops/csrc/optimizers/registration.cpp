// Schemas of the ampkit_optimizers ops (torch.ops.ampkit_optimizers.*). The CPU implementations are
// registered beside their kernels under CompositeExplicitAutograd, so calls with only empty lists (no
// tensor to pick a device from) still dispatch; they reject non-CPU tensors by name.
#include <torch/library.h>

TORCH_LIBRARY(ampkit_optimizers, m) {
  m.def(
      "adam_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] master_params, Tensor(f!)[] steps, float lr, float beta1, "
      "float beta2, float eps, float weight_decay, bool adam_w_mode, bool amsgrad, bool bias_correction, "
      "float grad_factor) -> ()");
  m.def(
      "sgd_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, Tensor(e!)[] master_params, "
      "float lr, float weight_decay, float momentum, float dampening, bool nesterov, bool first_step, "
      "float grad_factor) -> ()");
  m.def(
      "adagrad_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] state_sums, Tensor(e!)[] master_params, "
      "Tensor(f!)[] steps, float lr, float lr_decay, float weight_decay, float eps, float grad_factor) -> ()");
  m.def(
      "rmsprop_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] square_avgs, Tensor(c!)[] grad_avgs, "
      "Tensor(d!)[] momentum_buffers, Tensor(e!)[] master_params, Tensor(f!)[] steps, float lr, float alpha, "
      "float eps, float weight_decay, float momentum, bool centered, float grad_factor) -> ()");
  m.def(
      "rmsprop_tf_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] square_avgs, Tensor(c!)[] grad_avgs, "
      "Tensor(d!)[] momentum_buffers, Tensor(e!)[] master_params, Tensor(f!)[] steps, float lr, float alpha, "
      "float eps, float weight_decay, float momentum, bool centered, bool decoupled_decay, bool lr_in_momentum, "
      "float grad_factor) -> ()");
  m.def(
      "adadelta_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] square_avgs, Tensor(c!)[] acc_deltas, "
      "Tensor(e!)[] master_params, Tensor(f!)[] steps, float lr, float rho, float eps, float weight_decay, "
      "float grad_factor) -> ()");
  m.def(
      "lamb_stage1(Tensor[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] updates, Tensor[] master_params, Tensor(f!)[] steps, float beta1, float beta2, float eps, "
      "float weight_decay, bool adam_w_mode, bool grad_averaging, bool bias_correction, float grad_factor) -> ()");
  m.def(
      "lamb_stage2(Tensor(a!)[] params, Tensor[] updates, Tensor(e!)[] master_params, Tensor ratios) -> ()");
  m.def(
      "novograd_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(e!)[] master_params, "
      "Tensor denoms, float lr, float beta1, float weight_decay, bool reg_inside_moment, bool grad_averaging, "
      "float bias_correction1, float grad_factor) -> ()");
}
