/* A stand-in libnixl.so for the refusal test (tests/versions/refusal.sh): it exports only
 * what the plugin's layout detector reads (src/adapter/host_nixl.h), chosen at compile
 * time, so a test can plant the symbol set of a NIXL that no release has shipped.
 *   -DSET_V07 / -DSET_V010 / -DSET_V1   the base-class defaults of a shipped layout
 *   -DEXTRA_PROXY     supportsProxy() (a NIXL branch, unreleased)
 *   -DEXTRA_INJECT    supportsNotifInjection() (a NIXL branch, unreleased)
 *   -DEXTRA_TRACER    a tracer class (init params with a tracer pointer, unreleased)
 *   -DEXTRA_UNKNOWN   a base-class method no release has
 *   -DEXTRA_VIEWS1    1.x's memory views on top of another set (a mix no release has)
 *   -DDLIST_VT_WORDS=n   words in `vtable for nixlDescList<nixlMetaDesc>` (7 in 1.x, 8 before)
 *   -DTYPE_OFF=n      where getType() reads the memory type (8 in every release)
 * The names are Itanium-mangled C++ names, which are plain C identifiers; the bodies are
 * never called except the three descriptor-list accessors, which read a list the way the
 * real ones do (type at +TYPE_OFF, begin/end at +16/+24, 32-byte descriptors). */
#include <stddef.h>
#include <stdint.h>

#define STUB(name) \
    void name(void); \
    void name(void) {}

#if defined(SET_V07) || defined(SET_V010) || defined(SET_V1)
STUB(_ZNK17nixlBackendEngine13getPublicDataEPK13nixlBackendMDRNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE)
STUB(_ZNK17nixlBackendEngine11getConnInfoERNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE)
STUB(_ZN17nixlBackendEngine18loadRemoteConnInfoERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEES7_)
STUB(_ZN17nixlBackendEngine12loadRemoteMDERK12nixlBlobDescRK10nixl_mem_tRKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEERP13nixlBackendMD)
STUB(_ZN17nixlBackendEngine11loadLocalMDEP13nixlBackendMDRS1_)
STUB(_ZN17nixlBackendEngine9getNotifsERSt6vectorISt4pairINSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEES7_ESaIS8_EE)
STUB(_ZNK17nixlBackendEngine8genNotifERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEES7_)
STUB(_ZNK17nixlBackendEngine8queryMemERK12nixlDescListI12nixlBlobDescERSt6vectorISt8optionalISt13unordered_mapINSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEESD_St4hashISD_ESt8equal_toISD_ESaISt4pairIKSD_SD_EEEESaISN_EE)
STUB(_ZNK17nixlBackendEngine16estimateXferCostERK14nixl_xfer_op_tRK12nixlDescListI12nixlMetaDescES7_RKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEERKP15nixlBackendReqHRNSt6chrono8durationIlSt5ratioILl1ELl1000000EEEESP_R11nixl_cost_tPK21nixlAgentOptionalArgs)
#endif

#if defined(SET_V07) || defined(SET_V010)
STUB(_ZNK17nixlBackendEngine16createGpuXferReqERK15nixlBackendReqHRK12nixlDescListI12nixlMetaDescES7_RPv)
STUB(_ZNK17nixlBackendEngine17releaseGpuXferReqEPv)
STUB(_ZNK17nixlBackendEngine16getGpuSignalSizeERm)
STUB(_ZNK17nixlBackendEngine13prepGpuSignalERK13nixlBackendMDPvPK23nixlBackendOptionalArgs)
#endif

#if defined(SET_V010)
STUB(_ZNK17nixlBackendEngine14prepMemoryViewERK12nixlDescListI12nixlMetaDescERPvPK23nixlBackendOptionalArgs)
STUB(_ZNK17nixlBackendEngine14prepMemoryViewERK12nixlDescListI18nixlRemoteMetaDescERPvPK23nixlBackendOptionalArgs)
STUB(_ZNK17nixlBackendEngine17releaseMemoryViewEPv)
#endif

#if defined(SET_V1) || defined(EXTRA_VIEWS1)
STUB(_ZNK17nixlBackendEngine11prepMemViewERK12nixlDescListI12nixlMetaDescERPvPK23nixlBackendOptionalArgs)
STUB(_ZNK17nixlBackendEngine11prepMemViewERK12nixlDescListI18nixlRemoteMetaDescERPvPK23nixlBackendOptionalArgs)
STUB(_ZNK17nixlBackendEngine14releaseMemViewEPv)
#endif

#ifdef EXTRA_PROXY
STUB(_ZNK17nixlBackendEngine13supportsProxyEv)
#endif
#ifdef EXTRA_INJECT
STUB(_ZNK17nixlBackendEngine22supportsNotifInjectionEv)
#endif
#ifdef EXTRA_TRACER
STUB(_ZN10nixlTracer5startEv)
#endif
#ifdef EXTRA_UNKNOWN
STUB(_ZNK17nixlBackendEngine13getEndpointIdEv)
#endif

#ifndef DLIST_VT_WORDS
#define DLIST_VT_WORDS 7
#endif
#ifndef TYPE_OFF
#define TYPE_OFF 8
#endif

const void *_ZTV12nixlDescListI12nixlMetaDescE[DLIST_VT_WORDS] = {0};

size_t _ZNK12nixlDescListI12nixlMetaDescE9descCountEv(const char *self);
size_t _ZNK12nixlDescListI12nixlMetaDescE9descCountEv(const char *self) {
    const char *begin = *(const char *const *)(self + 16);
    const char *end = *(const char *const *)(self + 24);
    return (size_t)(end - begin) / 32;
}

uint32_t _ZNK12nixlDescListI12nixlMetaDescE7getTypeEv(const char *self);
uint32_t _ZNK12nixlDescListI12nixlMetaDescE7getTypeEv(const char *self) {
    return *(const uint32_t *)(self + TYPE_OFF);
}

const void *_ZNK12nixlDescListI12nixlMetaDescE5beginEv(const char *self);
const void *_ZNK12nixlDescListI12nixlMetaDescE5beginEv(const char *self) {
    return *(const void *const *)(self + 16);
}
