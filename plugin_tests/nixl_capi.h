/* The few functions of the stock NIXL agent's C API (libnixl_capi.so, nixl-cu12 1.5.1) that
 * the C tests and examples use, declared from the ABI document (§8): no NIXL header is used.
 * Shared by plugin_tests/agent_capi.c and examples/trtllm_flow.c. */
#ifndef NF_NIXL_CAPI_H
#define NF_NIXL_CAPI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>


typedef int nixl_capi_status_t; /* 0 success, 1 in progress, negative errors */
enum { CAPI_SUCCESS = 0, CAPI_IN_PROG = 1 };
enum { CAPI_MEM_DRAM = 0 };
enum { CAPI_OP_READ = 0, CAPI_OP_WRITE = 1 };

typedef struct nixl_capi_agent_s *nixl_capi_agent_t;
typedef struct nixl_capi_params_s *nixl_capi_params_t;
typedef struct nixl_capi_mem_list_s *nixl_capi_mem_list_t;
typedef struct nixl_capi_string_list_s *nixl_capi_string_list_t;
typedef struct nixl_capi_backend_s *nixl_capi_backend_t;
typedef struct nixl_capi_opt_args_s *nixl_capi_opt_args_t;
typedef struct nixl_capi_param_iter_s *nixl_capi_param_iter_t;
typedef struct nixl_capi_xfer_dlist_s *nixl_capi_xfer_dlist_t;
typedef struct nixl_capi_reg_dlist_s *nixl_capi_reg_dlist_t;
typedef struct nixl_capi_xfer_req_s *nixl_capi_xfer_req_t;
typedef struct nixl_capi_notif_map_s *nixl_capi_notif_map_t;

/* §8.3, 40 bytes */
typedef struct {
    bool enable_prog_thread;
    bool enable_listen_thread;
    int listen_port;
    int thread_sync; /* 0 NONE, 1 STRICT, 2 RW */
    unsigned num_workers;
    uint64_t pthr_delay_us;
    uint64_t lthr_delay_us;
    bool capture_telemetry;
} nixl_capi_agent_config_t;
_Static_assert(sizeof(nixl_capi_agent_config_t) == 40, "agent config is 40 bytes");
_Static_assert(offsetof(nixl_capi_agent_config_t, listen_port) == 4, "listen_port at 4");
_Static_assert(offsetof(nixl_capi_agent_config_t, thread_sync) == 8, "thread_sync at 8");
_Static_assert(offsetof(nixl_capi_agent_config_t, pthr_delay_us) == 16, "pthr_delay_us at 16");
_Static_assert(offsetof(nixl_capi_agent_config_t, capture_telemetry) == 32, "capture_telemetry at 32");

nixl_capi_status_t nixl_capi_create_agent(const char *name, nixl_capi_agent_t *agent);
nixl_capi_status_t nixl_capi_create_configured_agent(const char *name, const nixl_capi_agent_config_t *cfg,
                                                     nixl_capi_agent_t *agent);
nixl_capi_status_t nixl_capi_destroy_agent(nixl_capi_agent_t agent);

nixl_capi_status_t nixl_capi_get_available_plugins(nixl_capi_agent_t agent, nixl_capi_string_list_t *plugins);
nixl_capi_status_t nixl_capi_string_list_size(nixl_capi_string_list_t list, size_t *size);
nixl_capi_status_t nixl_capi_string_list_get(nixl_capi_string_list_t list, size_t index, const char **str);
nixl_capi_status_t nixl_capi_destroy_string_list(nixl_capi_string_list_t list);

nixl_capi_status_t nixl_capi_get_plugin_params(nixl_capi_agent_t agent, const char *plugin_name,
                                               nixl_capi_mem_list_t *mems, nixl_capi_params_t *params);
nixl_capi_status_t nixl_capi_get_backend_params(nixl_capi_agent_t agent, nixl_capi_backend_t backend,
                                                nixl_capi_mem_list_t *mems, nixl_capi_params_t *params);
nixl_capi_status_t nixl_capi_mem_list_size(nixl_capi_mem_list_t list, size_t *size);
nixl_capi_status_t nixl_capi_mem_list_get(nixl_capi_mem_list_t list, size_t index, int *mem_type);
nixl_capi_status_t nixl_capi_destroy_mem_list(nixl_capi_mem_list_t list);

nixl_capi_status_t nixl_capi_create_params(nixl_capi_params_t *params);
nixl_capi_status_t nixl_capi_params_add(nixl_capi_params_t params, const char *key, const char *value);
nixl_capi_status_t nixl_capi_params_create_iterator(nixl_capi_params_t params, nixl_capi_param_iter_t *iter);
nixl_capi_status_t nixl_capi_params_iterator_next(nixl_capi_param_iter_t iter, const char **key,
                                                  const char **value, bool *has_next);
nixl_capi_status_t nixl_capi_params_destroy_iterator(nixl_capi_param_iter_t iter);
nixl_capi_status_t nixl_capi_destroy_params(nixl_capi_params_t params);

nixl_capi_status_t nixl_capi_create_backend(nixl_capi_agent_t agent, const char *plugin_name,
                                            nixl_capi_params_t params, nixl_capi_backend_t *backend);
nixl_capi_status_t nixl_capi_destroy_backend(nixl_capi_backend_t backend);

nixl_capi_status_t nixl_capi_create_reg_dlist(int mem_type, nixl_capi_reg_dlist_t *dlist);
nixl_capi_status_t nixl_capi_reg_dlist_add_desc(nixl_capi_reg_dlist_t dlist, uintptr_t addr, size_t len,
                                                uint64_t dev_id, const void *metadata, size_t metadata_len);
nixl_capi_status_t nixl_capi_destroy_reg_dlist(nixl_capi_reg_dlist_t dlist);
nixl_capi_status_t nixl_capi_register_mem(nixl_capi_agent_t agent, nixl_capi_reg_dlist_t dlist,
                                          nixl_capi_opt_args_t opt_args);
nixl_capi_status_t nixl_capi_deregister_mem(nixl_capi_agent_t agent, nixl_capi_reg_dlist_t dlist,
                                            nixl_capi_opt_args_t opt_args);

nixl_capi_status_t nixl_capi_get_local_md(nixl_capi_agent_t agent, void **data, size_t *len);
nixl_capi_status_t nixl_capi_load_remote_md(nixl_capi_agent_t agent, const void *data, size_t len,
                                            char **agent_name);
nixl_capi_status_t nixl_capi_invalidate_remote_md(nixl_capi_agent_t agent, const char *remote_agent);

nixl_capi_status_t nixl_capi_create_xfer_dlist(int mem_type, nixl_capi_xfer_dlist_t *dlist);
nixl_capi_status_t nixl_capi_xfer_dlist_add_desc(nixl_capi_xfer_dlist_t dlist, uintptr_t addr, size_t len,
                                                 uint64_t dev_id);
nixl_capi_status_t nixl_capi_destroy_xfer_dlist(nixl_capi_xfer_dlist_t dlist);

nixl_capi_status_t nixl_capi_create_opt_args(nixl_capi_opt_args_t *args);
nixl_capi_status_t nixl_capi_destroy_opt_args(nixl_capi_opt_args_t args);
nixl_capi_status_t nixl_capi_opt_args_add_backend(nixl_capi_opt_args_t args, nixl_capi_backend_t backend);
nixl_capi_status_t nixl_capi_opt_args_set_notif_msg(nixl_capi_opt_args_t args, const void *data, size_t len);
nixl_capi_status_t nixl_capi_opt_args_set_has_notif(nixl_capi_opt_args_t args, bool has_notif);

nixl_capi_status_t nixl_capi_create_xfer_req(nixl_capi_agent_t agent, int operation,
                                             nixl_capi_xfer_dlist_t local_descs,
                                             nixl_capi_xfer_dlist_t remote_descs, const char *remote_agent,
                                             nixl_capi_xfer_req_t *req_hndl, nixl_capi_opt_args_t opt_args);
nixl_capi_status_t nixl_capi_post_xfer_req(nixl_capi_agent_t agent, nixl_capi_xfer_req_t req_hndl,
                                           nixl_capi_opt_args_t opt_args);
nixl_capi_status_t nixl_capi_get_xfer_status(nixl_capi_agent_t agent, nixl_capi_xfer_req_t req_hndl);
nixl_capi_status_t nixl_capi_release_xfer_req(nixl_capi_agent_t agent, nixl_capi_xfer_req_t req);
nixl_capi_status_t nixl_capi_destroy_xfer_req(nixl_capi_xfer_req_t req);

nixl_capi_status_t nixl_capi_create_notif_map(nixl_capi_notif_map_t *notif_map);
nixl_capi_status_t nixl_capi_notif_map_clear(nixl_capi_notif_map_t map);
nixl_capi_status_t nixl_capi_destroy_notif_map(nixl_capi_notif_map_t notif_map);
nixl_capi_status_t nixl_capi_get_notifs(nixl_capi_agent_t agent, nixl_capi_notif_map_t notif_map,
                                        nixl_capi_opt_args_t opt_args);
nixl_capi_status_t nixl_capi_notif_map_size(nixl_capi_notif_map_t map, size_t *size);
nixl_capi_status_t nixl_capi_notif_map_get_agent_at(nixl_capi_notif_map_t map, size_t index,
                                                    const char **agent_name);
nixl_capi_status_t nixl_capi_notif_map_get_notifs_size(nixl_capi_notif_map_t map, const char *agent_name,
                                                       size_t *size);
nixl_capi_status_t nixl_capi_notif_map_get_notif(nixl_capi_notif_map_t map, const char *agent_name,
                                                 size_t index, const void **data, size_t *len);
nixl_capi_status_t nixl_capi_gen_notif(nixl_capi_agent_t agent, const char *remote_agent, const void *data,
                                       size_t len, nixl_capi_opt_args_t opt_args);

enum { CAPI_SYNC_NONE = 0, CAPI_SYNC_STRICT = 1, CAPI_SYNC_RW = 2 };

/* Metadata through the listener thread (exported by the 1.5.1 libnixl_capi.so; signatures
 * from NIXL's src/bindings/rust/wrapper.h). With an IP address in the options they only
 * queue work for the agent's listener thread and return at once: poll check_remote_md. */
nixl_capi_status_t nixl_capi_fetch_remote_md(nixl_capi_agent_t agent, const char *remote_name,
                                             nixl_capi_opt_args_t opt_args);

nixl_capi_status_t nixl_capi_send_local_md(nixl_capi_agent_t agent, nixl_capi_opt_args_t opt_args);

nixl_capi_status_t nixl_capi_check_remote_md(nixl_capi_agent_t agent, const char *remote_name,
                                             nixl_capi_xfer_dlist_t descs);

nixl_capi_status_t nixl_capi_opt_args_set_ip_addr(nixl_capi_opt_args_t args, const char *ip_addr);

nixl_capi_status_t nixl_capi_opt_args_set_port(nixl_capi_opt_args_t args, uint16_t port);

#endif
