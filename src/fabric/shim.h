/* Out-of-line wrappers for the libfabric calls that the headers define as static inline.
 * Rust cannot call a static inline function, so each one used by src/fabric/ gets a
 * one-line wrapper here, compiled by build.rs with cc. Only src/fabric/ uses these. */
#ifndef NF_FABRIC_SHIM_H
#define NF_FABRIC_SHIM_H
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>

struct fi_info *nf_fi_allocinfo(void);
int nf_fi_close(struct fid *fid);
int nf_fi_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain, void *ctx);
int nf_fi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep, void *ctx);
int nf_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq, void *ctx);
int nf_fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av, void *ctx);
int nf_fi_ep_bind_cq(struct fid_ep *ep, struct fid_cq *cq, uint64_t flags);
int nf_fi_ep_bind_av(struct fid_ep *ep, struct fid_av *av);
int nf_fi_enable(struct fid_ep *ep);
int nf_fi_getname(struct fid_ep *ep, void *addr, size_t *addrlen);
int nf_fi_av_insert(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr, uint64_t flags);
int nf_fi_av_remove(struct fid_av *av, fi_addr_t *fi_addr, size_t count);
/* fi_mr_regattr of one contiguous buffer, optionally device memory (iface != FI_HMEM_SYSTEM;
 * `device_only`: memory of a device allocation, not managed, registered with
 * FI_HMEM_DEVICE_ONLY). Built in C because fi_mr_attr's layout differs between 1.x and 2.x
 * (mr_iov moved into an anonymous union), which C names the same way in both. */
int nf_fi_mr_reg_buf(struct fid_domain *domain, void *buf, size_t len, uint64_t access, uint64_t key,
                     int iface, int device, int device_only, struct fid_mr **mr);
/* The same over a dma-buf (FI_MR_DMABUF, libfabric >= 1.20 at run time only): the region is
 * bytes [offset, offset + len) of the dma-buf `fd`, whose offset 0 is at `base_addr`. */
int nf_fi_mr_reg_dmabuf(struct fid_domain *domain, int fd, uint64_t offset, size_t len, void *base_addr,
                        uint64_t access, uint64_t key, int iface, int device, struct fid_mr **mr);
void *nf_fi_mr_desc(struct fid_mr *mr);
uint64_t nf_fi_mr_key(struct fid_mr *mr);
ssize_t nf_fi_cq_read(struct fid_cq *cq, void *buf, size_t count);
ssize_t nf_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags);
const char *nf_fi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data, char *buf, size_t len);
ssize_t nf_fi_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags);
ssize_t nf_fi_readmsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags);
ssize_t nf_fi_send(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest, void *ctx);
ssize_t nf_fi_inject(struct fid_ep *ep, const void *buf, size_t len, fi_addr_t dest);
ssize_t nf_fi_recv(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src, void *ctx);
int nf_fi_cq_wait_fd(struct fid_cq *cq, int *fd);
int nf_fi_trywait_cq(struct fid_fabric *fabric, struct fid_cq *cq);
#endif
