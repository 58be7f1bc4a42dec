// io_uring set-up (io_uring_setup + three mmaps), submission-queue filling and completion reaping.
#include "uring.h"

#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace mobiuspipe {
namespace {

int sys_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(syscall(__NR_io_uring_setup, entries, p));
}

int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}

template <typename T>
T* at(void* base, uint32_t off) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + off);
}

void* map(int fd, size_t len, off_t what) {
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, what);
  return p == MAP_FAILED ? nullptr : p;
}

}  // namespace

std::unique_ptr<Uring> Uring::create(unsigned entries, std::string* why) {
  io_uring_params p;
  std::memset(&p, 0, sizeof(p));
  int fd = sys_setup(entries, &p);
  if (fd < 0) {
    *why = std::string("io_uring_setup: ") + std::strerror(errno);
    return nullptr;
  }
  std::unique_ptr<Uring> r(new Uring());
  r->fd_ = fd;
  r->entries_ = p.sq_entries;
  r->sq_map_len_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
  r->cq_map_len_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
  const bool single = p.features & IORING_FEAT_SINGLE_MMAP;
  if (single) r->sq_map_len_ = r->cq_map_len_ = std::max(r->sq_map_len_, r->cq_map_len_);
  r->sq_map_ = map(fd, r->sq_map_len_, IORING_OFF_SQ_RING);
  r->cq_map_ = single ? r->sq_map_ : map(fd, r->cq_map_len_, IORING_OFF_CQ_RING);
  r->sqes_map_len_ = p.sq_entries * sizeof(io_uring_sqe);
  r->sqes_map_ = map(fd, r->sqes_map_len_, IORING_OFF_SQES);
  if (!r->sq_map_ || !r->cq_map_ || !r->sqes_map_) {
    *why = std::string("io_uring mmap: ") + std::strerror(errno);
    return nullptr;  // the destructor unmaps what was mapped
  }
  r->sq_tail_ = at<unsigned>(r->sq_map_, p.sq_off.tail);
  r->sq_mask_ = at<unsigned>(r->sq_map_, p.sq_off.ring_mask);
  r->sq_array_ = at<unsigned>(r->sq_map_, p.sq_off.array);
  r->cq_head_ = at<unsigned>(r->cq_map_, p.cq_off.head);
  r->cq_tail_ = at<unsigned>(r->cq_map_, p.cq_off.tail);
  r->cq_mask_ = at<unsigned>(r->cq_map_, p.cq_off.ring_mask);
  r->cqes_ = at<void>(r->cq_map_, p.cq_off.cqes);
  return r;
}

Uring::~Uring() {
  if (sqes_map_) munmap(sqes_map_, sqes_map_len_);
  if (cq_map_ && cq_map_ != sq_map_) munmap(cq_map_, cq_map_len_);
  if (sq_map_) munmap(sq_map_, sq_map_len_);
  if (fd_ >= 0) close(fd_);
}

io_uring_sqe* Uring::next_sqe() {
  const unsigned idx = *sq_tail_ & *sq_mask_;  // only this thread writes the tail
  io_uring_sqe* sqe = static_cast<io_uring_sqe*>(sqes_map_) + idx;
  std::memset(sqe, 0, sizeof(*sqe));
  return sqe;
}

void Uring::push_sqe() {
  const unsigned tail = *sq_tail_;
  const unsigned idx = tail & *sq_mask_;
  sq_array_[idx] = idx;
  __atomic_store_n(sq_tail_, tail + 1, __ATOMIC_RELEASE);
  ++to_submit_;
}

void Uring::prep(bool write, int fd, const iovec* iov, uint64_t offset, uint64_t user_data) {
  io_uring_sqe* sqe = next_sqe();
  sqe->opcode = write ? IORING_OP_WRITEV : IORING_OP_READV;
  sqe->fd = fd;
  sqe->addr = reinterpret_cast<uint64_t>(iov);
  sqe->len = 1;
  sqe->off = offset;
  sqe->user_data = user_data;
  push_sqe();
}

void Uring::prep_fixed(bool write, int fd, void* addr, uint32_t len, uint64_t offset, uint16_t buf_index,
                       uint64_t user_data) {
  io_uring_sqe* sqe = next_sqe();
  sqe->opcode = write ? IORING_OP_WRITE_FIXED : IORING_OP_READ_FIXED;
  sqe->fd = fd;
  sqe->addr = reinterpret_cast<uint64_t>(addr);
  sqe->len = len;
  sqe->off = offset;
  sqe->buf_index = buf_index;
  sqe->user_data = user_data;
  push_sqe();
}

int Uring::register_buffers(const iovec* iovs, unsigned n) {
  int ret = static_cast<int>(syscall(__NR_io_uring_register, fd_, IORING_REGISTER_BUFFERS, iovs, n));
  return ret < 0 ? -errno : 0;
}

int Uring::submit_and_wait(unsigned min_complete) {
  for (;;) {
    int ret = sys_enter(fd_, to_submit_, min_complete, IORING_ENTER_GETEVENTS);
    if (ret >= 0) {
      to_submit_ -= static_cast<unsigned>(ret);
      if (to_submit_ == 0) return 0;
      min_complete = 0;  // the kernel took part of the queue: hand it the rest
      continue;
    }
    if (errno == EINTR) continue;
    return -errno;  // EAGAIN/EBUSY: the caller reaps completions, then retries
  }
}

unsigned Uring::reap(const std::function<void(uint64_t, int32_t)>& on_cqe) {
  unsigned head = *cq_head_;
  const unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
  unsigned n = 0;
  for (; head != tail; ++head, ++n) {
    const io_uring_cqe* cqe = static_cast<const io_uring_cqe*>(cqes_) + (head & *cq_mask_);
    on_cqe(cqe->user_data, cqe->res);
  }
  __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
  return n;
}

}  // namespace mobiuspipe
