/*
 * The bootstrap's authentication: SipHash-2-4 against the reference's test vectors, and a hello tag
 * that changes with every field it covers (rank, nranks, nonce, magic) and with the secret.
 */
#include <string.h>

#include "core/bootstrap.h"
#include "core/internal.h"
#include "epx_test.h"

int main(void)
{
    unsigned char key[16], msg[64];
    for (int i = 0; i < 16; i++) key[i] = (unsigned char)i;
    for (int i = 0; i < 64; i++) msg[i] = (unsigned char)i;
    /* From the SipHash paper's reference implementation (vectors.h): lengths 0, 1, 7, 8, 15, 63. */
    EXPECT_TRUE(epx_siphash24(key, msg, 0) == 0x726fdb47dd0e0e31ull);
    EXPECT_TRUE(epx_siphash24(key, msg, 1) == 0x74f839c593dc67fdull);
    EXPECT_TRUE(epx_siphash24(key, msg, 7) == 0xab0200f58b01d137ull);
    EXPECT_TRUE(epx_siphash24(key, msg, 8) == 0x93f5f5799a932462ull);
    EXPECT_TRUE(epx_siphash24(key, msg, 15) == 0xa129ca6149be45e5ull);
    EXPECT_TRUE(epx_siphash24(key, msg, 63) == 0x958a324ceb064572ull);

    epx_boot_hello_t h;
    memset(&h, 0, sizeof(h));
    h.magic = EPX_BOOT_HELLO_MAGIC;
    h.rank = 3;
    h.nranks = 8;
    memset(h.nonce, 0x11, sizeof(h.nonce));
    epx_boot_hello_sign(&h, key);
    const epx_boot_hello_t base = h;
    for (int field = 0; field < 5; field++) {
        epx_boot_hello_t m = base;
        unsigned char other[16];
        memcpy(other, key, sizeof(other));
        switch (field) {
        case 0: m.rank = 4; break;
        case 1: m.nranks = 9; break;
        case 2: m.nonce[15] ^= 1; break;
        case 3: m.magic ^= 1; break;
        default: other[0] ^= 1; break;
        }
        epx_boot_hello_sign(&m, other);
        EXPECT_TRUE(memcmp(m.tag, base.tag, sizeof(m.tag)) != 0);
    }
    printf("boot auth: SipHash-2-4 vectors and hello tags ok\n");
    return 0;
}
