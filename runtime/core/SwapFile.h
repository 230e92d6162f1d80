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

/// How the swap file is read and written (fsdp-run --nvme-io).
enum class SwapIoMode {
  Auto,     ///< direct where the plan and the file system allow, else buffered
  Direct,   ///< O_DIRECT (DeepSpeed's aio): past the page cache, or an error
  Buffered, ///< pread / pwrite through the page cache
};

/// "auto", "direct" or "buffered" (--nvme-io), false for anything else.
bool parseSwapIoMode(const std::string &text, SwapIoMode &mode);

class SwapFile {
public:
  SwapFile() = default;
  SwapFile(const SwapFile &) = delete;
  SwapFile &operator=(const SwapFile &) = delete;
  ~SwapFile();

  /// Creates the file of `bytes` zero bytes in `dir` for `rank`, replacing
  /// any this object had open. `align`: the plan's swap_alignment (0 for a
  /// plan without one); `stagingAligned`: every staging buffer's address
  /// is a multiple of it. With SwapIoMode::Direct (or Auto) the file is
  /// then read and written with O_DIRECT, after a probe read and write of
  /// one block; Direct fails, naming the reason, where that is impossible
  /// (no alignment, a file system refusing O_DIRECT or that block), and
  /// Auto falls back to buffered I/O and says why (directNote()).
  Status open(const std::string &dir, int64_t rank, int64_t bytes,
              SwapIoMode mode = SwapIoMode::Buffered, int64_t align = 0,
              bool stagingAligned = false);
  bool isOpen() const { return fd >= 0; }
  int64_t size() const { return bytes; }
  /// The file's path when it was created (it is unlinked since).
  const std::string &path() const { return name; }
  /// Whether transfers bypass the page cache (O_DIRECT), and when they do
  /// not, why (empty when buffered I/O was asked for).
  bool direct() const { return isDirect; }
  const std::string &directNote() const { return note; }

  /// The plan's swaps: moves `n` bytes at `offset` to or from `staging`,
  /// as whole blocks of the alignment (`n` rounded up: the plan reserves
  /// those bytes at both ends; [Note: swap file] in Plan.h), so with
  /// O_DIRECT both must be multiples of it. The state's `n` bytes count in
  /// bytesRead / bytesWritten. Safe from several threads at once.
  Status swapIn(int64_t offset, void *staging, int64_t n) const;
  Status swapOut(int64_t offset, const void *staging, int64_t n) const;

  /// Exactly `n` bytes at any `offset` from or to any address
  /// (checkpoints, initialization; not counted): with O_DIRECT through an
  /// aligned bounce buffer, the blocks at either end read first so that
  /// a write changes only its own bytes. Short transfers and EINTR are
  /// retried; any other failure names the file and errno.
  Status read(int64_t offset, void *dst, int64_t n) const;
  Status write(int64_t offset, const void *src, int64_t n) const;

  /// Makes what was written durable and drops the file's pages from the
  /// page cache, so the next reads come from the disk (calibration).
  Status sync() const;
  /// The same for `n` bytes at `offset` only, and nothing with O_DIRECT
  /// (no page cache to write back or drop): the calibration's duplex
  /// phase, between transfers of one range on two threads. Safe beside
  /// swapIn / swapOut on other threads. A range only read (`written`
  /// false) has nothing to write back: its pages are only dropped.
  Status settle(int64_t offset, int64_t n, bool written = true) const;

  /// How many of the file's bytes the page cache holds now (mincore over
  /// a mapping of it; whole pages), or -1 where that cannot be told. With
  /// O_DIRECT none: [Note: swap file I/O].
  int64_t cachedBytes() const;

  /// Counted bytes moved so far each way (for the run's summary), and the
  /// seconds the swaps spent moving them (each transfer's wall time on its
  /// thread: the rate the drive gave the training, to set beside
  /// --calibrate's and the cost model's).
  int64_t bytesRead() const { return readTotal; }
  int64_t bytesWritten() const { return writeTotal; }
  double secondsReading() const { return readNs * 1e-9; }
  double secondsWriting() const { return writeNs * 1e-9; }

private:
  void close();
  /// pread or pwrite until all `n` bytes moved.
  Status transfer(bool write, int64_t offset, uint8_t *p, int64_t n) const;
  /// Direct mode's exact transfers (read / write above).
  Status bounced(bool write, int64_t offset, uint8_t *p, int64_t n) const;
  /// Turns O_DIRECT on and checks one block each way; why not, or empty.
  std::string tryDirect();
  int fd = -1;
  int64_t bytes = 0, blockBytes = 0; ///< blockBytes: the alignment, or 0
  bool isDirect = false;
  std::string name, note;
  mutable int64_t readTotal = 0, writeTotal = 0, readNs = 0, writeNs = 0;
  /// swapIn / swapOut: the transfer, counted.
  Status swap(bool write, int64_t offset, uint8_t *p, int64_t n) const;
};

/// fsdp-run --calibrate --nvme-dir DIR: the swap file's write (durable)
/// and read (from the disk) rates, every rank of `comm` at once on its own
/// file (ranks share a drive as they would in training), this rank's
/// figures as the profile's compute.nvme_write_bytes_per_s /
/// nvme_read_bytes_per_s (the cost model's, passes/CostModel.h), with the
/// I/O `mode` a run would use (Auto: direct where the disk allows it).
Status calibrateSwap(const std::string &dir, Communicator &comm, nlohmann::json &profile,
                     SwapIoMode mode = SwapIoMode::Auto);

} // namespace fsdp

#endif
