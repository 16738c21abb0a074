/*
 * A peer without the token, written on UCX's C APIs (UCP; UCT for uct-put): it opens a
 * client-server endpoint to a node's data-plane listener and, without ever authenticating, tries
 * UCX's one-sided operations (RMA) on an address in the node's process, or sends junk and vanishes.
 *
 *   ucp_intruder get HOST PORT ADDR LEN         read LEN bytes at ADDR (hex) in the node's process
 *   ucp_intruder put HOST PORT ADDR HEX         write the bytes HEX there
 *   ucp_intruder uct-put PORT ADDR HEX          the same write on UCT's TCP transport, to the node
 *                                               worker's TCP interface on the loopback device
 *   ucp_intruder junk HOST PORT                 stream, tagged and active messages of junk, a put
 *                                               to a wild address, then exit without closing
 *
 * Prints one line per step: CONNECTED, GOT <hex> / GET_FAILED <status>, PUT_DONE / PUT_FAILED
 * <status>, SENT; "FAILED <what> <status>" and exit status 2 where the attempt itself cannot be
 * made. Every wait is bounded: a refused operation never completes.
 */
#include <arpa/inet.h>
#include <netdb.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <ucp/api/ucp.h>
#include <uct/api/uct.h>

#define CONNECT_DEADLINE_S 20.0 /* setting up the connection (a loaded machine) */
#define DEADLINE_S         8.0  /* an operation: a refused one never completes */

static ucp_worker_h worker;
static ucs_status_t ep_error = UCS_OK;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    (void)arg;
    (void)ep;
    ep_error = status;
}

/* The status of an operation started with a *_nbx call: its request progressed to its end, or
 * UCS_ERR_TIMED_OUT after `seconds` (the request is then cancelled). */
static ucs_status_t wait_within(ucs_status_ptr_t request, double seconds)
{
    double deadline = now() + seconds;
    ucs_status_t status;

    if (request == NULL) {
        return UCS_OK;
    }
    if (UCS_PTR_IS_ERR(request)) {
        return UCS_PTR_STATUS(request);
    }
    while ((status = ucp_request_check_status(request)) == UCS_INPROGRESS) {
        if (now() > deadline) {
            ucp_request_cancel(worker, request);
            return UCS_ERR_TIMED_OUT;
        }
        ucp_worker_progress(worker);
    }
    ucp_request_free(request);
    return status;
}

static ucs_status_t wait_for(ucs_status_ptr_t request)
{
    return wait_within(request, DEADLINE_S);
}

static void print_hex(const char *label, const unsigned char *bytes, size_t n)
{
    printf("%s ", label);
    for (size_t i = 0; i < n; i++) {
        printf("%02x", bytes[i]);
    }
    printf("\n");
    fflush(stdout);
}

static ucp_ep_h connect_to(const char *host, const char *port)
{
    struct addrinfo hints = {0}, *found = NULL;
    ucp_ep_params_t params = {0};
    ucp_request_param_t flush = {0};
    ucs_status_t status;
    ucp_ep_h ep;

    hints.ai_family   = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, port, &hints, &found) != 0 || found == NULL) {
        printf("FAILED resolve %s:%s\n", host, port);
        exit(2);
    }
    params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.flags            = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    params.sockaddr.addr    = found->ai_addr;
    params.sockaddr.addrlen = found->ai_addrlen;
    params.err_mode         = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb   = on_ep_error;
    params.err_handler.arg  = NULL;
    status                  = ucp_ep_create(worker, &params, &ep);
    freeaddrinfo(found);
    if (status != UCS_OK) {
        printf("FAILED connect %s\n", ucs_status_string(status));
        exit(2);
    }
    /* A flush completes once the connection is set up (the lanes to the node are known). */
    status = wait_within(ucp_ep_flush_nbx(ep, &flush), CONNECT_DEADLINE_S);
    if (status != UCS_OK || ep_error != UCS_OK) {
        printf("FAILED connect %s\n", ucs_status_string(status != UCS_OK ? status : ep_error));
        exit(2);
    }
    printf("CONNECTED\n");
    fflush(stdout);
    return ep;
}

/* A key to this process's own buffer, unpacked for the endpoint to the node: UCX asks the
 * initiator for a key, but over TCP nothing on the node's side checks it against its memory. */
static ucp_rkey_h own_key(ucp_context_h context, ucp_ep_h ep, void *buffer, size_t length)
{
    ucp_mem_map_params_t map = {0};
    ucp_mem_h memh;
    void *packed;
    size_t packed_size;
    ucp_rkey_h rkey;

    map.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    map.address    = buffer;
    map.length     = length;
    if (ucp_mem_map(context, &map, &memh) != UCS_OK ||
        ucp_rkey_pack(context, memh, &packed, &packed_size) != UCS_OK) {
        printf("FAILED key\n");
        exit(2);
    }
    if (ucp_ep_rkey_unpack(ep, packed, &rkey) != UCS_OK) {
        printf("FAILED unpack\n");
        exit(2);
    }
    ucp_rkey_buffer_release(packed);
    return rkey;
}

static int get_once(ucp_ep_h ep, ucp_rkey_h rkey, uint64_t address, unsigned char *into,
                    size_t length)
{
    ucp_request_param_t param = {0};
    ucs_status_t status;

    memset(into, 0, length);
    status = wait_for(ucp_get_nbx(ep, into, length, address, rkey, &param));
    if (status == UCS_OK) {
        /* A get may end "done" on an endpoint the node already dropped: check the flush too. */
        ucp_request_param_t flush = {0};
        status = wait_for(ucp_ep_flush_nbx(ep, &flush));
    }
    if (status != UCS_OK || ep_error != UCS_OK) {
        printf("GET_FAILED %s\n", ucs_status_string(status != UCS_OK ? status : ep_error));
        fflush(stdout);
        return 0;
    }
    print_hex("GOT", into, length);
    return 1;
}

static int parse_hex(const char *text, unsigned char *out, size_t length)
{
    if (strlen(text) != 2 * length) {
        return 0;
    }
    for (size_t i = 0; i < length; i++) {
        unsigned int byte;
        if (sscanf(text + 2 * i, "%2x", &byte) != 1) {
            return 0;
        }
        out[i] = (unsigned char)byte;
    }
    return 1;
}

static void rma(ucp_context_h context, ucp_ep_h ep, int put, char **argv)
{
    uint64_t address = strtoull(argv[4], NULL, 16);
    size_t length    = put ? strlen(argv[5]) / 2 : strtoull(argv[5], NULL, 10);
    unsigned char *local;
    ucp_rkey_h rkey;

    if (length == 0 || length > (1 << 20)) {
        printf("FAILED length\n");
        exit(2);
    }
    local = calloc(1, length);
    if (put && !parse_hex(argv[5], local, length)) {
        printf("FAILED hex\n");
        exit(2);
    }
    rkey = own_key(context, ep, local, length);
    if (!put) {
        get_once(ep, rkey, address, local, length);
        return;
    }
    {
        ucp_request_param_t param = {0}, flush = {0};
        ucs_status_t status = wait_for(ucp_put_nbx(ep, local, length, address, rkey, &param));
        if (status == UCS_OK) {
            status = wait_for(ucp_ep_flush_nbx(ep, &flush)); /* the put reached the node */
        }
        if (status != UCS_OK || ep_error != UCS_OK) {
            printf("PUT_FAILED %s\n", ucs_status_string(status != UCS_OK ? status : ep_error));
        } else {
            printf("PUT_DONE\n");
        }
        fflush(stdout);
    }
}

static void junk(ucp_context_h context, ucp_ep_h ep)
{
    static unsigned char bytes[64 * 1024];
    ucp_request_param_t param = {0};

    for (size_t i = 0; i < sizeof(bytes); i++) {
        bytes[i] = (unsigned char)(i * 131 + 7);
    }
    /* Where ucxx expects its 16-byte peer information: a wrong checksum, then more. */
    wait_for(ucp_stream_send_nbx(ep, bytes, sizeof(bytes), &param));
    for (ucp_tag_t tag = 0; tag < 8; tag++) {
        wait_for(ucp_tag_send_nbx(ep, bytes, 1000 + 4096 * tag, tag * 0x0101010101010101ull, &param));
    }
    for (unsigned id = 0; id < 4; id++) {
        wait_for(ucp_am_send_nbx(ep, id, bytes, 16, bytes, sizeof(bytes), &param));
    }
    /* A put to a wild address: with RMA served it would crash the node. */
    {
        ucp_rkey_h rkey = own_key(context, ep, bytes, sizeof(bytes));
        wait_for(ucp_put_nbx(ep, bytes, 64, 0x10, rkey, &param));
    }
    printf("SENT\n");
    fflush(stdout);
    _exit(0); /* no close, no flush: the node sees the connection drop */
}

static void on_uct_done(uct_completion_t *self)
{
    (void)self;
}

/* The status of a UCT operation that returned `status` with `comp` as its completion. */
static ucs_status_t uct_wait(uct_worker_h uworker, ucs_status_t status, uct_completion_t *comp)
{
    double deadline = now() + DEADLINE_S;

    if (status != UCS_INPROGRESS) {
        return status;
    }
    while (comp->count > 0) {
        if (now() > deadline) {
            return UCS_ERR_TIMED_OUT;
        }
        uct_worker_progress(uworker);
    }
    return comp->status;
}

/* One level down, on UCT's TCP transport itself (no UCP, no listener): connect to the TCP
 * interface a node's UCX worker listens on (its port is in the worker address UCX sends to any
 * peer that connects; the test reads it from /proc) on the loopback device, and write there. */
static void uct_put(char **argv)
{
    const char *port_text = argv[2];
    uint64_t address      = strtoull(argv[3], NULL, 16);
    size_t length         = strlen(argv[4]) / 2;
    uct_component_h *components, tcp = NULL;
    unsigned num_components, num_resources;
    uct_component_attr_t attr = {0};
    uct_md_resource_desc_t mds[16];
    uct_tl_resource_desc_t *resources;
    uct_md_config_t *md_config;
    uct_iface_config_t *iface_config;
    uct_iface_params_t iface_params = {0};
    uct_iface_attr_t iface_attr;
    uct_ep_params_t ep_params = {0};
    ucs_async_context_t *async;
    uct_worker_h uworker;
    uct_iface_h iface;
    uct_md_h md;
    uct_ep_h ep;
    unsigned char *dev_addr, *value = calloc(1, length ? length : 1);
    uint16_t port = htons((uint16_t)atoi(port_text));
    uct_iov_t iov;
    uct_completion_t comp = {on_uct_done, 1, UCS_OK};
    ucs_status_t status;

    if (length == 0 || !parse_hex(argv[4], value, length)) {
        printf("FAILED hex\n");
        exit(2);
    }
    if (uct_query_components(&components, &num_components) != UCS_OK) {
        printf("FAILED components\n");
        exit(2);
    }
    for (unsigned i = 0; i < num_components; i++) {
        attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME | UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT;
        if (uct_component_query(components[i], &attr) == UCS_OK && strcmp(attr.name, "tcp") == 0 &&
            attr.md_resource_count > 0 && attr.md_resource_count <= 16) {
            tcp = components[i];
            break;
        }
    }
    attr.field_mask   = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
    attr.md_resources = mds;
    if (tcp == NULL || uct_component_query(tcp, &attr) != UCS_OK ||
        uct_md_config_read(tcp, NULL, NULL, &md_config) != UCS_OK ||
        uct_md_open(tcp, mds[0].md_name, md_config, &md) != UCS_OK ||
        uct_md_query_tl_resources(md, &resources, &num_resources) != UCS_OK ||
        uct_md_iface_config_read(md, "tcp", NULL, NULL, &iface_config) != UCS_OK ||
        ucs_async_context_create(UCS_ASYNC_MODE_THREAD_SPINLOCK, &async) != UCS_OK ||
        uct_worker_create(async, UCS_THREAD_MODE_SINGLE, &uworker) != UCS_OK) {
        printf("FAILED uct\n");
        exit(2);
    }
    iface_params.field_mask           = UCT_IFACE_PARAM_FIELD_OPEN_MODE | UCT_IFACE_PARAM_FIELD_DEVICE;
    iface_params.open_mode            = UCT_IFACE_OPEN_MODE_DEVICE;
    iface_params.mode.device.tl_name  = "tcp";
    iface_params.mode.device.dev_name = "lo";
    if (uct_iface_open(md, uworker, &iface_params, iface_config, &iface) != UCS_OK ||
        uct_iface_query(iface, &iface_attr) != UCS_OK) {
        printf("FAILED iface\n");
        exit(2);
    }
    uct_iface_progress_enable(iface, UCT_PROGRESS_SEND | UCT_PROGRESS_RECV);
    /* On one host the loopback device's address is the same for every process: ours is the
     * node's; the interface address is its port. */
    dev_addr = calloc(1, iface_attr.device_addr_len);
    if (uct_iface_get_device_address(iface, (uct_device_addr_t*)dev_addr) != UCS_OK) {
        printf("FAILED address\n");
        exit(2);
    }
    ep_params.field_mask = UCT_EP_PARAM_FIELD_IFACE | UCT_EP_PARAM_FIELD_DEV_ADDR |
                           UCT_EP_PARAM_FIELD_IFACE_ADDR;
    ep_params.iface      = iface;
    ep_params.dev_addr   = (uct_device_addr_t*)dev_addr;
    ep_params.iface_addr = (uct_iface_addr_t*)&port;
    if (uct_ep_create(&ep_params, &ep) != UCS_OK) {
        printf("FAILED connect\n");
        exit(2);
    }
    printf("CONNECTED\n");
    iov.buffer = value;
    iov.length = length;
    iov.memh   = UCT_MEM_HANDLE_NULL;
    iov.stride = 0;
    iov.count  = 1;
    {
        double deadline = now() + DEADLINE_S;
        /* No resource: the connection to the node is still being set up. */
        while ((status = uct_ep_put_zcopy(ep, &iov, 1, address, 0, &comp)) == UCS_ERR_NO_RESOURCE &&
               now() < deadline) {
            uct_worker_progress(uworker);
        }
    }
    status = uct_wait(uworker, status, &comp);
    if (status == UCS_OK) {
        comp.count = 1;
        status     = uct_wait(uworker, uct_ep_flush(ep, 0, &comp), &comp);
    }
    if (status != UCS_OK) {
        printf("PUT_FAILED %s\n", ucs_status_string(status));
    } else {
        printf("PUT_DONE\n");
    }
    fflush(stdout);
    _exit(0);
}

int main(int argc, char **argv)
{
    ucp_params_t params               = {0};
    ucp_worker_params_t worker_params = {0};
    ucp_context_h context;
    ucp_config_t *config;
    ucp_ep_h ep;

    int get = argc == 6 && strcmp(argv[1], "get") == 0;
    int put = argc == 6 && strcmp(argv[1], "put") == 0;

    if (argc == 5 && strcmp(argv[1], "uct-put") == 0) {
        uct_put(argv);
    }
    if (!get && !put && !(argc == 4 && strcmp(argv[1], "junk") == 0)) {
        fprintf(stderr, "usage: %s get HOST PORT ADDR LEN | put HOST PORT ADDR HEX | junk HOST PORT | "
                "uct-put PORT ADDR HEX\n",
                argv[0]);
        return 64;
    }
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features   = UCP_FEATURE_RMA | UCP_FEATURE_TAG | UCP_FEATURE_STREAM | UCP_FEATURE_AM;
    if (ucp_config_read(NULL, NULL, &config) != UCS_OK ||
        ucp_init(&params, config, &context) != UCS_OK) {
        printf("FAILED init\n");
        return 2;
    }
    ucp_config_release(config);
    worker_params.field_mask  = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
    if (ucp_worker_create(context, &worker_params, &worker) != UCS_OK) {
        printf("FAILED worker\n");
        return 2;
    }
    ep = connect_to(argv[2], argv[3]);
    if (strcmp(argv[1], "junk") == 0) {
        junk(context, ep);
    }
    rma(context, ep, put, argv);
    fflush(stdout);
    _exit(0); /* the node drops this endpoint anyway; a polite close could wait on it */
}
