// The argument contract of each ampkit_optimizers op, checked once for the CPU and the CUDA entry points:
// every list against `params` (see ListChecker), then the op's optional lists and step counters.
#pragma once

#include <ATen/core/Tensor.h>

#include "optimizers/list_checks.h"

namespace ampkit {
namespace optim {

// What an op's checks establish: the gradients' dtype and whether fp32 master copies are present.
struct CheckedArgs {
  at::ScalarType grad_dtype;
  bool has_master;
};

inline CheckedArgs check_adam_args(const ListChecker& check, at::TensorList grads, at::TensorList exp_avgs,
                                   at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                                   at::TensorList master_params, at::TensorList steps, bool amsgrad) {
  const at::ScalarType grad_dtype = check.grads(grads);
  check.state("exp_avgs", exp_avgs);
  check.state("exp_avg_sqs", exp_avg_sqs);
  check.optional_state("max_exp_avg_sqs", max_exp_avg_sqs, amsgrad);
  const bool has_master = check.master(master_params);
  check.steps(steps);
  return {grad_dtype, has_master};
}

inline CheckedArgs check_sgd_args(const ListChecker& check, at::TensorList grads, at::TensorList momentum_buffers,
                                  at::TensorList master_params, bool use_momentum) {
  const at::ScalarType grad_dtype = check.grads(grads);
  check.optional_state("momentum_buffers", momentum_buffers, use_momentum);
  return {grad_dtype, check.master(master_params)};
}

inline CheckedArgs check_adagrad_args(const ListChecker& check, at::TensorList grads, at::TensorList state_sums,
                                      at::TensorList master_params, at::TensorList steps) {
  const at::ScalarType grad_dtype = check.grads(grads);
  check.state("state_sums", state_sums);
  const bool has_master = check.master(master_params);
  check.steps(steps);
  return {grad_dtype, has_master};
}

// RMSprop and TF-style RMSprop take the same lists.
inline CheckedArgs check_rmsprop_args(const ListChecker& check, at::TensorList grads, at::TensorList square_avgs,
                                      at::TensorList grad_avgs, at::TensorList momentum_buffers,
                                      at::TensorList master_params, at::TensorList steps, bool centered,
                                      bool use_momentum) {
  const at::ScalarType grad_dtype = check.grads(grads);
  check.state("square_avgs", square_avgs);
  check.optional_state("grad_avgs", grad_avgs, centered);
  check.optional_state("momentum_buffers", momentum_buffers, use_momentum);
  const bool has_master = check.master(master_params);
  check.steps(steps);
  return {grad_dtype, has_master};
}

inline CheckedArgs check_adadelta_args(const ListChecker& check, at::TensorList grads, at::TensorList square_avgs,
                                       at::TensorList acc_deltas, at::TensorList master_params,
                                       at::TensorList steps) {
  const at::ScalarType grad_dtype = check.grads(grads);
  check.state("square_avgs", square_avgs);
  check.state("acc_deltas", acc_deltas);
  const bool has_master = check.master(master_params);
  check.steps(steps);
  return {grad_dtype, has_master};
}

inline CheckedArgs check_lamb_stage1_args(const ListChecker& check, at::TensorList grads, at::TensorList exp_avgs,
                                          at::TensorList exp_avg_sqs, at::TensorList updates,
                                          at::TensorList master_params, at::TensorList steps) {
  const at::ScalarType grad_dtype = check.grads(grads);
  check.state("exp_avgs", exp_avgs);
  check.state("exp_avg_sqs", exp_avg_sqs);
  check.state("updates", updates);
  const bool has_master = check.master(master_params);
  check.host_steps(steps);
  return {grad_dtype, has_master};
}

inline CheckedArgs check_novograd_args(const ListChecker& check, at::TensorList grads, at::TensorList exp_avgs,
                                       at::TensorList master_params) {
  const at::ScalarType grad_dtype = check.grads(grads);
  check.state("exp_avgs", exp_avgs);
  return {grad_dtype, check.master(master_params)};
}

inline CheckedArgs check_adamp_args(const ListChecker& check, at::TensorList grads, at::TensorList exp_avgs,
                                    at::TensorList exp_avg_sqs, at::TensorList master_params, at::TensorList steps) {
  const at::ScalarType grad_dtype = check.grads(grads);
  check.state("exp_avgs", exp_avgs);
  check.state("exp_avg_sqs", exp_avg_sqs);
  const bool has_master = check.master(master_params);
  check.host_steps(steps);
  return {grad_dtype, has_master};
}

}  // namespace optim
}  // namespace ampkit
