// Precompiled header of the fuzz build: the LibTorch headers the parsers include. Of c10d only
// Work, which shardrl/dist.h (reached through the public headers) holds by intrusive_ptr; the main
// build's pch.h adds the process groups, which no parser needs.
#pragma once
#include <torch/torch.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>
