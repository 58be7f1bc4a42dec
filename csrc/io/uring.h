// A minimal io_uring ring over the raw system calls (no liburing needed): readv/writev submission, reaping.
#pragma once
#include <sys/uio.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

struct io_uring_sqe;  // <linux/io_uring.h>, included by uring.cpp only

namespace mobiuspipe {

class Uring {
 public:
  // A ring of `entries` submission slots; nullptr with `why` set when the kernel refuses io_uring
  // (ENOSYS on old kernels, EPERM under seccomp profiles or kernel.io_uring_disabled).
  static std::unique_ptr<Uring> create(unsigned entries, std::string* why);
  ~Uring();
  Uring(const Uring&) = delete;
  Uring& operator=(const Uring&) = delete;

  unsigned entries() const { return entries_; }
  // Queue one readv/writev of `iov` (which must stay valid until its completion) at file `offset`.
  void prep(bool write, int fd, const iovec* iov, uint64_t offset, uint64_t user_data);
  // Queue a read/write of [addr, addr + len) that lies inside registered buffer `buf_index`.
  void prep_fixed(bool write, int fd, void* addr, uint32_t len, uint64_t offset, uint16_t buf_index,
                  uint64_t user_data);
  // Register memory regions once (the kernel pins them now instead of on every I/O): 0 or -errno.
  int register_buffers(const iovec* iovs, unsigned n);
  // Submit everything queued and wait for at least `min_complete` completions. Returns 0 or -errno.
  int submit_and_wait(unsigned min_complete);
  // Call on_cqe(user_data, res) for every completion ready now; returns how many.
  unsigned reap(const std::function<void(uint64_t, int32_t)>& on_cqe);

 private:
  Uring() = default;
  ::io_uring_sqe* next_sqe();  // the zeroed entry at the tail
  void push_sqe();             // publish it to the kernel
  int fd_ = -1;
  unsigned entries_ = 0;
  unsigned to_submit_ = 0;
  void* sq_map_ = nullptr;
  size_t sq_map_len_ = 0;
  void* cq_map_ = nullptr;
  size_t cq_map_len_ = 0;
  void* sqes_map_ = nullptr;
  size_t sqes_map_len_ = 0;
  unsigned* sq_tail_ = nullptr;
  unsigned* sq_mask_ = nullptr;
  unsigned* sq_array_ = nullptr;
  unsigned* cq_head_ = nullptr;
  unsigned* cq_tail_ = nullptr;
  unsigned* cq_mask_ = nullptr;
  void* cqes_ = nullptr;
};

}  // namespace mobiuspipe
