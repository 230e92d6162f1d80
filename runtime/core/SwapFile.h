//===- SwapFile.h - a rank's optimizer state on disk ------------*- C++ -*-===//
//
// fsdp-offload's nvme (ZeRO-Infinity's optimizer offload to NVMe): the
// state the plan places in space "nvme" lives in one file per rank, read
// into the host arena's staging buffers before each update and written
// back after ([Note: swap file] in Plan.h). The file is created in the
// directory fsdp-run --nvme-dir names, reserved whole at once (a full disk
// fails at start, not in the middle of training) and unlinked as soon as
// it is open, so no run leaves one behind, however it ends.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_SWAPFILE_H
#define FSDP_RUNTIME_CORE_SWAPFILE_H

#include "runtime/core/Status.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace fsdp {

class Communicator;

class SwapFile {
public:
  SwapFile() = default;
  SwapFile(const SwapFile &) = delete;
  SwapFile &operator=(const SwapFile &) = delete;
  ~SwapFile();

  /// Creates the file of `bytes` zero bytes in `dir` for `rank`, replacing
  /// any this object had open.
  Status open(const std::string &dir, int64_t rank, int64_t bytes);
  bool isOpen() const { return fd >= 0; }
  int64_t size() const { return bytes; }
  /// The file's path when it was created (it is unlinked since).
  const std::string &path() const { return name; }

  /// Reads or writes `n` bytes at `offset`, all of them (short transfers
  /// and EINTR are retried); any other failure names the file and errno.
  /// Safe from several threads at once (pread / pwrite). `counted`: the
  /// bytes count in bytesRead / bytesWritten (the training steps' swaps;
  /// not checkpoints).
  Status read(int64_t offset, void *dst, int64_t n, bool counted = true) const;
  Status write(int64_t offset, const void *src, int64_t n, bool counted = true) const;

  /// Makes what was written durable and drops the file's pages from the
  /// page cache, so the next reads come from the disk (calibration).
  Status sync() const;

  /// Counted bytes moved so far each way (for the run's summary).
  int64_t bytesRead() const { return readTotal; }
  int64_t bytesWritten() const { return writeTotal; }

private:
  void close();
  /// read / write: pread or pwrite until all `n` bytes moved.
  Status transfer(bool write, int64_t offset, uint8_t *p, int64_t n, bool counted) const;
  int fd = -1;
  int64_t bytes = 0;
  std::string name;
  mutable int64_t readTotal = 0, writeTotal = 0;
};

/// fsdp-run --calibrate --nvme-dir DIR: the swap file's write (durable)
/// and read (from the disk) rates, every rank of `comm` at once on its own
/// file (ranks share a drive as they would in training), this rank's
/// figures as the profile's compute.nvme_write_bytes_per_s /
/// nvme_read_bytes_per_s (the cost model's, passes/CostModel.h).
Status calibrateSwap(const std::string &dir, Communicator &comm, nlohmann::json &profile);

} // namespace fsdp

#endif
