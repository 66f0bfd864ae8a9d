/* The bootstrap ABI from C: embedded server, client, registration with
 * keep-alive, lookup and summary as JSON with size queries, the handshake
 * re-check, typed errors. Built with -Wall -Werror and run under valgrind. */
#include "pdxfer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

_Static_assert(sizeof(PdxBootstrapServerConfig) == 40, "PdxBootstrapServerConfig size is ABI");

static const char *REG =
    "{\"schema_version\":1,\"cluster\":\"ctest\",\"role\":\"prefill\",\"dp_size\":1,\"dp_rank\":0,"
    "\"topology\":{\"engine_rank\":0,\"attn_tp_size\":1,\"attn_tp_rank\":0,\"attn_cp_size\":1,"
    "\"attn_cp_rank\":0,\"pp_size\":1,\"pp_rank\":0,\"dcp_size\":1,\"dcp_rank\":0,\"dcp_interleave\":1,"
    "\"page_size\":64,\"kv_dtype\":\"bf16\",\"pool\":\"mla\","
    "\"entries\":[{\"layer_id\":0,\"row_bytes\":1152}]},"
    "\"endpoints\":{\"tcp\":\"127.0.0.1:7000\"},\"regions\":[]}";

int main(void) {
    PdxBootstrapServerConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.struct_size = sizeof cfg;
    cfg.listen = "127.0.0.1:0";
    cfg.token = "c-token";
    PdxBootstrapServer *srv = NULL;
    CHECK(pdxfer_bootstrap_server_start(&cfg, &srv) == PDX_STATUS_OK);

    size_t need = 0;
    CHECK(pdxfer_bootstrap_server_url(srv, NULL, 0, &need) == PDX_STATUS_OK);
    CHECK(need > 8);
    char small[4];
    CHECK(pdxfer_bootstrap_server_url(srv, small, sizeof small, &need) == PDX_STATUS_BUFFER_TOO_SMALL);
    char url[128];
    CHECK(pdxfer_bootstrap_server_url(srv, url, sizeof url, &need) == PDX_STATUS_OK);
    CHECK(strncmp(url, "http://127.0.0.1:", 17) == 0);

    PdxBootstrapClient *anon = NULL, *client = NULL;
    CHECK(pdxfer_bootstrap_client_open(url, NULL, &anon) == PDX_STATUS_OK);
    CHECK(pdxfer_bootstrap_client_open(url, "c-token", &client) == PDX_STATUS_OK);

    PdxRegistration *reg = NULL;
    CHECK(pdxfer_bootstrap_register(anon, REG, 3000, &reg) == PDX_STATUS_UNAUTHORIZED);
    CHECK(reg == NULL);
    CHECK(pdxfer_bootstrap_register(client, REG, 3000, &reg) == PDX_STATUS_OK);

    char buf[8192];
    CHECK(pdxfer_registration_json(reg, buf, sizeof buf, &need) == PDX_STATUS_OK);
    CHECK(strstr(buf, "\"instance_id\":\"") != NULL);
    CHECK(pdxfer_bootstrap_lookup(client, "ctest", "prefill", "dp0-tp0-cp0-pp0", buf, sizeof buf, &need) ==
          PDX_STATUS_OK);
    CHECK(strstr(buf, "127.0.0.1:7000") != NULL);
    CHECK(pdxfer_bootstrap_lookup(anon, "ctest", "prefill", "dp0-tp0-cp0-pp0", buf, sizeof buf, &need) ==
          PDX_STATUS_UNAUTHORIZED);
    CHECK(pdxfer_bootstrap_lookup(client, "ctest", "prefill", "dp0-tp5-cp0-pp0", buf, sizeof buf, &need) ==
          PDX_STATUS_NOT_REGISTERED);
    CHECK(pdxfer_bootstrap_summary(anon, "ctest", "prefill", buf, sizeof buf, &need) == PDX_STATUS_OK);
    CHECK(strstr(buf, "\"ready\":true") != NULL);
    CHECK(pdxfer_bootstrap_summary(client, "ctest", "router", buf, sizeof buf, &need) ==
          PDX_STATUS_INVALID_ARGUMENT);
    CHECK(pdxfer_bootstrap_lookup(NULL, "ctest", "prefill", "dp0-tp0-cp0-pp0", buf, sizeof buf, &need) ==
          PDX_STATUS_NULL_ARGUMENT);
    CHECK(pdxfer_bootstrap_verify_peer("{", "{}", "{}", buf, sizeof buf, &need) == PDX_STATUS_INVALID_ARGUMENT);

    CHECK(pdxfer_registration_deregister(reg) == PDX_STATUS_OK);
    CHECK(pdxfer_bootstrap_lookup(client, "ctest", "prefill", "dp0-tp0-cp0-pp0", buf, sizeof buf, &need) ==
          PDX_STATUS_NOT_REGISTERED);
    CHECK(pdxfer_registration_destroy(NULL) == PDX_STATUS_OK);
    CHECK(pdxfer_bootstrap_client_close(anon) == PDX_STATUS_OK);
    CHECK(pdxfer_bootstrap_client_close(client) == PDX_STATUS_OK);
    CHECK(pdxfer_bootstrap_server_stop(srv) == PDX_STATUS_OK);
    CHECK(pdxfer_bootstrap_server_stop(NULL) == PDX_STATUS_OK);

    return CHECK_SUMMARY();
}
