/* Rooms named by request ids over the C ABI: pdxfer_room_for_key is stable
 * (the same key gives the same room, keys that differ give different rooms,
 * below 2^63), refuses an empty or over-long key and writes nothing then;
 * pdxfer_engine_bind_room_key refuses a NULL engine. Run under valgrind. */
#include "check.h"

#include <stdint.h>
#include <string.h>

int main(void) {
    uint64_t a = 0, a2 = 0, b = 0;
    const char *k = "cmpl-4f2a-0";
    CHECK(pdxfer_room_for_key((const uint8_t *)k, strlen(k), &a) == PDX_STATUS_OK);
    CHECK(pdxfer_room_for_key((const uint8_t *)k, strlen(k), &a2) == PDX_STATUS_OK);
    CHECK(a == a2);
    CHECK(a < (UINT64_C(1) << 63));
    CHECK(pdxfer_room_for_key((const uint8_t *)"cmpl-4f2a-1", 11, &b) == PDX_STATUS_OK);
    CHECK(a != b);

    uint64_t untouched = 77;
    CHECK(pdxfer_room_for_key((const uint8_t *)k, 0, &untouched) == PDX_STATUS_INVALID_ARGUMENT);
    CHECK(untouched == 77);
    static uint8_t big[PDXFER_MAX_ROOM_KEY_BYTES + 1];
    memset(big, 'x', sizeof big);
    CHECK(pdxfer_room_for_key(big, sizeof big, &untouched) == PDX_STATUS_INVALID_ARGUMENT);
    CHECK(pdxfer_room_for_key(big, sizeof big - 1, &untouched) == PDX_STATUS_OK);
    CHECK(pdxfer_room_for_key(NULL, 3, &untouched) == PDX_STATUS_NULL_ARGUMENT);
    CHECK(pdxfer_room_for_key((const uint8_t *)k, strlen(k), NULL) == PDX_STATUS_NULL_ARGUMENT);
    CHECK(pdxfer_engine_bind_room_key(NULL, (const uint8_t *)k, strlen(k), &untouched) == PDX_STATUS_NULL_ARGUMENT);
    CHECK(PDX_STATUS_ROOM_KEY_COLLISION == -910);
    return CHECK_SUMMARY();
}
