// Preference pairs for offline Diffusion-DPO (algorithm.sample_source: offline), in verl-omni's
// offline DPO rows (verl_omni/utils/dataset/offline_dpo_dataset.py) as JSON lines: one pair a
// line, {"prompt", "img_win_latents", "img_lose_latents", "win_score", "lose_score", "uid"}, the
// latents as nested lists. A diffusion run writes such lines for every step under
// trainer.rollout_data_dir (the best and worst sample of each prompt's group), so an offline run
// can train on what an online one sampled.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

namespace shardrl::trainer {

struct PreferencePairs {
  std::vector<std::string> prompts;              // per pair
  std::vector<std::string> uids;                 // per pair
  torch::Tensor chosen, rejected;                // [P, C, H, W] fp32
  torch::Tensor chosen_scores, rejected_scores;  // [P] fp32
  int64_t size() const { return static_cast<int64_t>(prompts.size()); }
};

// Reads every line of `files` (.jsonl). The prompt is extra_info.raw_prompt when present, else
// "prompt" (a string, or chat messages whose user turns are joined); scores default to 1 and 0, as
// verl-omni's; a latent [H, W] gets its channel. Latents must have `sample_shape` [C, H, W]. A
// missing field, a wrong shape or win_score < lose_score is an error naming the file, the line
// and the field; `key` (the config key that listed the files) leads every message.
PreferencePairs read_preference_pairs(const std::vector<std::string>& files,
                                      const std::vector<int64_t>& sample_shape,
                                      const std::string& key);

// Writes the pairs as JSON lines to `path` (replacing it, atomically), with verl's rollout dump
// fields beside verl-omni's: "input" (the prompt), "score" (win_score) and "step".
void write_preference_pairs(const std::string& path, const PreferencePairs& pairs, int64_t step);

}  // namespace shardrl::trainer
