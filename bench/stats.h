// The statistics every benchmark quotes: the median of its timed repeats (the mean of the middle
// two for an even count), so one slow step on shared cores does not move the figure.
#pragma once

#include <algorithm>
#include <vector>

namespace shardrl::bench {

inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace shardrl::bench
