// The `shardrl` command line.
#include <CLI/CLI.hpp>

#include <iostream>

#include "shardrl/launcher.h"

int main(int argc, char** argv) {
  CLI::App app{"ShardRL: fully sharded data-parallel training and RL post-training in C++"};
  app.require_subcommand(1);

  shardrl::dist::LaunchOptions launch;
  auto* launch_cmd = app.add_subcommand(
      "launch", "Start N local ranks of a command with the torchrun environment");
  launch_cmd->add_option("-n,--nproc-per-node", launch.nproc, "Ranks to start")
      ->required()
      ->check(CLI::PositiveNumber);
  launch_cmd
      ->add_option("--master-port", launch.master_port, "Rendezvous port (default: a free one)")
      ->check(CLI::Range(0, 65535));
  launch_cmd->add_option("--master-addr", launch.master_addr, "Rendezvous address");
  launch_cmd->add_option("--threads", launch.threads_per_rank,
                         "Compute threads per rank (default: cores / N, or OMP_NUM_THREADS)");
  launch_cmd->add_option("--grace", launch.grace_seconds,
                         "Seconds the other ranks get to report after one fails");
  launch_cmd->add_option("command", launch.command, "Command to run on every rank (after --)")
      ->required();

  CLI11_PARSE(app, argc, argv);
  try {
    if (app.got_subcommand(launch_cmd)) return shardrl::dist::launch(launch);
  } catch (const std::exception& e) {
    std::cerr << "shardrl: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
