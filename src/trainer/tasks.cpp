#include "tasks.h"

namespace shardrl::trainer {

void register_builtin_tasks(std::map<std::string, Task>& tasks) {
  tasks["lm_pretrain"] = {lm_pretrain_defaults, run_lm_pretrain};
  tasks["diffusion_rl"] = {diffusion_rl_defaults, run_diffusion_rl};
  tasks["lm_grpo"] = {lm_grpo_defaults, run_lm_grpo};
}

}  // namespace shardrl::trainer
