/* See shim.h: one out-of-line wrapper per static-inline libfabric call we use. */
#include "shim.h"
#include <string.h>

struct fi_info *nf_fi_allocinfo(void) { return fi_allocinfo(); }
int nf_fi_close(struct fid *fid) { return fi_close(fid); }
int nf_fi_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain, void *ctx)
{ return fi_domain(fabric, info, domain, ctx); }
int nf_fi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep, void *ctx)
{ return fi_endpoint(domain, info, ep, ctx); }
int nf_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq, void *ctx)
{ return fi_cq_open(domain, attr, cq, ctx); }
int nf_fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av, void *ctx)
{ return fi_av_open(domain, attr, av, ctx); }
int nf_fi_ep_bind_cq(struct fid_ep *ep, struct fid_cq *cq, uint64_t flags)
{ return fi_ep_bind(ep, &cq->fid, flags); }
int nf_fi_ep_bind_av(struct fid_ep *ep, struct fid_av *av) { return fi_ep_bind(ep, &av->fid, 0); }
int nf_fi_enable(struct fid_ep *ep) { return fi_enable(ep); }
int nf_fi_getname(struct fid_ep *ep, void *addr, size_t *addrlen) { return fi_getname(&ep->fid, addr, addrlen); }
int nf_fi_av_insert(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr, uint64_t flags)
{ return fi_av_insert(av, addr, count, fi_addr, flags, NULL); }
int nf_fi_av_remove(struct fid_av *av, fi_addr_t *fi_addr, size_t count)
{ return fi_av_remove(av, fi_addr, count, 0); }
/* fi_mr_attr as the library reads it. A fabric opened with API version >= 1.19 has the
 * library read fields that 1.17's headers do not declare (hmem_data from 1.19, page_size
 * from 1.22, base_mr and sub_mr_cnt from 2.0), so the attribute lives in a zeroed block
 * larger than any layout: the fields our headers lack read as NULL/0. */
union nf_mr_attr {
	struct fi_mr_attr attr;
	char room[sizeof(struct fi_mr_attr) + 128];
};

static int nf_mr_regattr(struct fid_domain *domain, union nf_mr_attr *u, uint64_t access, uint64_t key,
                         int iface, int device, uint64_t flags, struct fid_mr **mr)
{
	u->attr.iov_count = 1;
	u->attr.access = access;
	u->attr.requested_key = key;
	u->attr.iface = (enum fi_hmem_iface)iface;
	if (iface == FI_HMEM_CUDA)
		u->attr.device.cuda = device;
	return fi_mr_regattr(domain, &u->attr, flags, mr);
}

int nf_fi_mr_reg_buf(struct fid_domain *domain, void *buf, size_t len, uint64_t access, uint64_t key,
                     int iface, int device, int device_only, struct fid_mr **mr)
{
	struct iovec iov = { .iov_base = buf, .iov_len = len };
	union nf_mr_attr u;
	memset(&u, 0, sizeof u);
	u.attr.mr_iov = &iov;
	/* fi_mr(3): FI_HMEM_DEVICE_ONLY marks memory of a device allocation call. shm takes the
	 * device-to-device IPC protocol only for regions registered with it; without it every
	 * byte goes through its host bounce buffers. */
	return nf_mr_regattr(domain, &u, access, key, iface, device, device_only ? FI_HMEM_DEVICE_ONLY : 0, mr);
}

/* fi_mr(3) of libfabric >= 1.20: "struct fi_mr_dmabuf { int fd; uint64_t offset; size_t len;
 * void *base_addr; }", selected over mr_iov (the same union slot of fi_mr_attr) by the
 * registration flag FI_MR_DMABUF, (1ULL << 40) in fi_domain.h. Declared here under our own
 * name because the 1.17 headers we build against lack both; the caller uses this only
 * where the library at run time is >= 1.20 and the fabric was opened with API 1.20. */
struct nf_fi_mr_dmabuf {
	int fd;
	uint64_t offset;
	size_t len;
	void *base_addr;
};
#define NF_FI_MR_DMABUF (1ULL << 40)
#ifdef FI_MR_DMABUF
_Static_assert(FI_MR_DMABUF == NF_FI_MR_DMABUF, "FI_MR_DMABUF as fi_mr(3) documents it");
_Static_assert(sizeof(struct fi_mr_dmabuf) == sizeof(struct nf_fi_mr_dmabuf), "fi_mr_dmabuf layout");
#endif

int nf_fi_mr_reg_dmabuf(struct fid_domain *domain, int fd, uint64_t offset, size_t len, void *base_addr,
                        uint64_t access, uint64_t key, int iface, int device, struct fid_mr **mr)
{
	struct nf_fi_mr_dmabuf d = { .fd = fd, .offset = offset, .len = len, .base_addr = base_addr };
	union nf_mr_attr u;
	memset(&u, 0, sizeof u);
	u.attr.mr_iov = (const struct iovec *)(const void *)&d;
	return nf_mr_regattr(domain, &u, access, key, iface, device, NF_FI_MR_DMABUF, mr);
}
void *nf_fi_mr_desc(struct fid_mr *mr) { return fi_mr_desc(mr); }
uint64_t nf_fi_mr_key(struct fid_mr *mr) { return fi_mr_key(mr); }
ssize_t nf_fi_cq_read(struct fid_cq *cq, void *buf, size_t count) { return fi_cq_read(cq, buf, count); }
ssize_t nf_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags)
{ return fi_cq_readerr(cq, buf, flags); }
const char *nf_fi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data, char *buf, size_t len)
{ return fi_cq_strerror(cq, prov_errno, err_data, buf, len); }
ssize_t nf_fi_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags)
{ return fi_writemsg(ep, msg, flags); }
ssize_t nf_fi_readmsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags)
{ return fi_readmsg(ep, msg, flags); }
ssize_t nf_fi_send(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest, void *ctx)
{ return fi_send(ep, buf, len, desc, dest, ctx); }
ssize_t nf_fi_inject(struct fid_ep *ep, const void *buf, size_t len, fi_addr_t dest)
{ return fi_inject(ep, buf, len, dest); }
ssize_t nf_fi_recv(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src, void *ctx)
{ return fi_recv(ep, buf, len, desc, src, ctx); }
int nf_fi_cq_wait_fd(struct fid_cq *cq, int *fd) { return fi_control(&cq->fid, FI_GETWAIT, fd); }
int nf_fi_trywait_cq(struct fid_fabric *fabric, struct fid_cq *cq)
{
	struct fid *fids[1] = { &cq->fid };
	return fi_trywait(fabric, fids, 1);
}
