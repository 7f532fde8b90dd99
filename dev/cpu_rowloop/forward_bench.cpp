// The CPU cross-entropy forward alone, for counting instructions (callgrind) and timing the row
// loop on one thread: logits of a trained-looking spread, float32, repeated calls.
// Build against a configured tree, then run (median time and read rate; under
// `valgrind --tool=callgrind` for an instruction count):
//   g++ -O2 -std=c++17 -Iinclude dev/cpu_rowloop/forward_bench.cpp build/libfusedce.a \
//     build/fusedce_openblas/*.a -lpthread -o /tmp/fwd_bench
//   /tmp/fwd_bench N V reps threads
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include <algorithm>

#include "fusedce/fusedce.h"

using namespace fusedce;

int main(int argc, char** argv) {
  const int64_t N = argc > 1 ? atoll(argv[1]) : 128, V = argc > 2 ? atoll(argv[2]) : 32000;
  const int reps = argc > 3 ? atoi(argv[3]) : 50, threads = argc > 4 ? atoi(argv[4]) : 1;
  std::vector<float> x(N * V);
  std::vector<int64_t> t(N);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (auto& v : x) v = nd(rng);
  for (auto& v : t) v = rng() % V;
  std::vector<float> loss(1), lse(N);
  MatrixView lg{x.data(), DType::kFloat32, N, V, V};
  VectorView tg{t.data(), DType::kInt64, N, 1};
  Options o;
  ForwardOutputs out;
  out.loss = VectorView{loss.data(), DType::kFloat32, 1, 1};
  out.lse = VectorView{lse.data(), DType::kFloat32, N, 1};
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    auto a = std::chrono::steady_clock::now();
    Status s = cross_entropy_forward(Device::cpu(threads), lg, tg, o, out);
    auto b = std::chrono::steady_clock::now();
    if (!s.ok()) { printf("error %s\n", s.message().c_str()); return 1; }
    ms.push_back(std::chrono::duration<double, std::milli>(b - a).count());
  }
  std::sort(ms.begin(), ms.end());
  printf("N=%lld V=%lld threads=%d median %.3f ms min %.3f ms  (%.2f GB/s) loss %.6f\n", (long long)N,
         (long long)V, threads, ms[ms.size() / 2], ms[0], N * V * 4 / ms[ms.size() / 2] / 1e6, loss[0]);
}
