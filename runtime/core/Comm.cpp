//===- Comm.cpp - the single-process communicator -------------------------===//

#include "runtime/core/Comm.h"

#include <algorithm>
#include <cstring>

namespace fsdp {

namespace {
class SingleProcess final : public Communicator {
public:
  int64_t rank() const override { return 0; }
  int64_t size() const override { return 1; }
  Status allReduce(const void *in, void *out, int64_t count, DType dtype, ReduceOp,
                   Stream *) override {
    if (in != out)
      std::memmove(out, in, dtypeSize(dtype) * count);
    return Status::ok();
  }
  Status reduceScatter(const void *in, void *out, int64_t shard, DType dtype,
                       ReduceOp, Stream *) override {
    if (in != out)
      std::memmove(out, in, dtypeSize(dtype) * shard);
    return Status::ok();
  }
  Status allGather(const void *in, void *out, int64_t shard, DType dtype,
                   Stream *) override {
    if (in != out)
      std::memmove(out, in, dtypeSize(dtype) * shard);
    return Status::ok();
  }
  Status allToAll(const void *in, void *out, int64_t chunk, DType dtype, Stream *) override {
    if (in != out)
      std::memmove(out, in, dtypeSize(dtype) * chunk);
    return Status::ok();
  }
  Status broadcast(void *, int64_t, int64_t) override { return Status::ok(); }
  Status barrier() override { return Status::ok(); }
};
} // namespace

Status Communicator::subgroup(const std::vector<int64_t> &ranks, const std::string &tag,
                              std::unique_ptr<Communicator> &out) {
  if (ranks.size() == 1 && ranks[0] == rank()) {
    out = makeSingleProcessCommunicator();
    return Status::ok();
  }
  return FSDP_ERROR("this communicator cannot form the group '", tag, "' of ",
                    ranks.size(), " ranks");
}

Status Communicator::checkGroup(const std::vector<int64_t> &ranks, const std::string &tag,
                                int64_t &index) const {
  auto me = std::find(ranks.begin(), ranks.end(), rank());
  if (me == ranks.end() || !std::is_sorted(ranks.begin(), ranks.end()) ||
      ranks.front() < 0 || ranks.back() >= size())
    return FSDP_ERROR("rank ", rank(), ": group '", tag, "' must list ranks of 0..",
                      size() - 1, " in order, this rank among them");
  index = me - ranks.begin();
  return Status::ok();
}

std::unique_ptr<Communicator> makeSingleProcessCommunicator() {
  return std::make_unique<SingleProcess>();
}

} // namespace fsdp
