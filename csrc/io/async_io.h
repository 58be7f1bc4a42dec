// Asynchronous tensor reads and writes at file offsets: io_uring or a thread pool, O_DIRECT with bounce
// buffers for unaligned memory or sizes, every completion checked.
#pragma once
#include <torch/extension.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "uring.h"

namespace mobiuspipe {

constexpr int64_t kAlign = 4096;     // O_DIRECT alignment of memory, offsets and lengths (bytes)
constexpr int64_t kShortRead = -1;   // status: the file ended before the requested bytes
constexpr int64_t kShortWrite = -2;  // status: a write made no progress (returned 0)

struct Request;

// One piece (at most block_bytes) of a request; resubmitted from `progress` after a short transfer.
struct Block {
  Request* req = nullptr;
  int64_t file_off = 0;  // where the piece starts in the file
  char* user = nullptr;  // where it starts in the tensor
  int64_t len = 0;       // bytes of tensor data
  int64_t io_len = 0;    // bytes on the wire: len, or len rounded up to kAlign when bounced
  bool bounced = false;  // goes through an aligned bounce buffer (O_DIRECT and unaligned memory/size)
  char* bounce = nullptr;
  int64_t progress = 0;  // bytes transferred so far
  bool ok = false;
  int fixed = -1;    // index of the registered buffer holding the piece (io_uring fixed I/O), or -1
  uint32_t crc = 0;  // CRC-32C of the piece's tensor bytes (when the request asks for it)
  iovec iov{};
};

// One submit(): a tensor's bytes to or from [offset, offset + nbytes) of a file.
struct Request {
  torch::Tensor keep;  // holds the memory until the request is waited for
  int fd = -1;
  bool write = false;
  bool direct = false;
  bool checksum = false;  // compute the CRC-32C of the bytes moved, piece by piece in the I/O threads
  std::vector<Block> blocks;
  int64_t blocks_left = 0;
  int64_t status = 0;        // 0, an errno (> 0), kShortRead or kShortWrite: the failure nearest the start
  int64_t fail_offset = -1;  // file offset of that failure
  int64_t bytes_done = 0;
  bool done = false;
};

class AsyncIO {
 public:
  // backend "auto" (io_uring, else threads), "uring" or "threads"; queue_depth = pieces in flight
  // (threads: that many workers); block_bytes = piece size, a multiple of kAlign.
  AsyncIO(const std::string& backend, int64_t queue_depth, int64_t block_bytes);
  ~AsyncIO();

  std::string backend() const { return ring_ ? "uring" : "threads"; }
  std::string fallback_reason() const { return why_not_uring_; }
  int64_t queue_depth() const { return queue_depth_; }
  int64_t block_bytes() const { return block_bytes_; }

  // Queue a read (write=false) or write of all of t's bytes at `offset` of fd; returns a ticket.
  // direct: fd was opened with O_DIRECT (offset must be a multiple of kAlign; memory and size need not).
  // checksum: also compute the CRC-32C of the tensor's bytes (written, or read), overlapped with the I/O.
  int64_t submit(int64_t fd, torch::Tensor t, int64_t offset, bool write, bool direct, bool checksum);
  // Block until the ticket's request ends: (status, fail_offset, bytes_done, crc32c or 0). The ticket is
  // then spent.
  std::tuple<int64_t, int64_t, int64_t, int64_t> wait(int64_t ticket);
  bool done(int64_t ticket);
  int64_t pending();
  // Register memory once with io_uring (pages pinned now, not on every I/O); later pieces that lie in
  // them use fixed-buffer reads/writes. Once per engine, while idle. Returns "" or why it did not.
  std::string register_buffers(std::vector<torch::Tensor> buffers);
  int64_t registered() const { return static_cast<int64_t>(fixed_.size()); }
  // Test hook: the nth completion from now (0 = the next) returns -err if err > 0, else at most
  // short_bytes bytes (a short transfer the engine must finish by resubmitting).
  void inject_fault(int64_t nth, int64_t err, int64_t short_bytes);

 private:
  void uring_loop();     // the one thread that fills and reaps the ring
  void finisher_loop();  // ends pieces the ring completed: bounce copies, checksums, request counts
  void post_finish(Block* b);
  void thread_loop();  // a pread/pwrite worker (threads backend)
  void start(Block* b, char* bounce);
  bool finish_io(Block* b, int64_t res);  // true: resubmit the rest of b
  void block_done(Block* b);
  void piece_ended(Request* r);  // one piece of r is over; the last one wakes its waiter (mu_ held)
  void fail(Request* r, int64_t status, int64_t offset);
  int64_t apply_fault(int64_t res);
  int fixed_index(const char* p, int64_t n) const;
  char* take_bounce();
  void give_bounce(char* p);
  void fail_all(int64_t err);

  std::unique_ptr<Uring> ring_;
  std::string why_not_uring_;
  int64_t queue_depth_;
  int64_t block_bytes_;
  uint32_t block_shift_;  // crc32c_shift(block_bytes_): folds a full piece's CRC into the request's
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Block*> queue_;
  std::unordered_map<int64_t, std::unique_ptr<Request>> requests_;
  int64_t next_ticket_ = 1;
  bool stop_ = false;
  int64_t broken_ = 0;  // an errno that made the ring unusable: later submits fail with it
  std::mutex bounce_mu_;
  std::vector<char*> bounce_free_;
  std::vector<char*> bounce_all_;
  std::atomic<int64_t> fault_countdown_{-1};
  int64_t fault_err_ = 0, fault_short_ = 0;
  std::vector<std::thread> workers_;
  std::mutex finish_mu_;
  std::condition_variable finish_cv_;
  std::deque<Block*> finish_q_;
  bool finish_stop_ = false;
  std::vector<std::thread> finishers_;
  std::vector<torch::Tensor> fixed_;  // registered buffers, kept alive; immutable once set
};

}  // namespace mobiuspipe
