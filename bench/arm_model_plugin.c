/*
 * qemu TCG plugin of bench/arm_model.py: the translation blocks a guest
 * executes between marker calls, in order.
 *
 * Debian's qemu-user (7.2) is built with plugin support but ships no
 * plugins (no libinsn.so), so this is a minimal one, written against the
 * version-1 plugin API of QEMU 5.2 .. 8.x (the declarations below are the
 * few functions it uses; qemu-user exports them).  Arguments:
 *
 *   begin=0xADDR,end=0xADDR,out=PATH
 *
 * Every time the guest executes the block starting at `begin` (the first
 * instruction of the driver's sa_model_begin) a window opens; the block at
 * `end` closes it.  Inside a window each executed block is written to PATH
 * as "vaddr n_insns" (hex address, decimal count), windows separated by a
 * line "W i".  Summing n_insns counts the guest instructions exactly (a
 * block runs to its end or faults; the driver does not fault); the sequence
 * expanded through a disassembly of the binary is the dynamic instruction
 * trace that bench/arm_model.py hands to llvm-mca.
 *
 * Build: cc -shared -fPIC -O2 bench/arm_model_plugin.c -o arm_model_plugin.so
 * Use:   qemu-aarch64 -plugin ./arm_model_plugin.so,begin=0x..,end=0x..,out=t.txt ./exe
 */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the version-1 plugin API (include/qemu/qemu-plugin.h of QEMU 7.2) ---- */
typedef uint64_t qemu_plugin_id_t;
typedef struct qemu_info_t qemu_info_t; /* not read */
struct qemu_plugin_tb;
enum qemu_plugin_cb_flags {
    QEMU_PLUGIN_CB_NO_REGS,
    QEMU_PLUGIN_CB_R_REGS,
    QEMU_PLUGIN_CB_RW_REGS,
};
typedef void (*qemu_plugin_vcpu_tb_trans_cb_t)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb);
typedef void (*qemu_plugin_vcpu_udata_cb_t)(unsigned int vcpu_index, void *userdata);
typedef void (*qemu_plugin_udata_cb_t)(qemu_plugin_id_t id, void *userdata);
void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_tb_trans_cb_t cb);
void qemu_plugin_register_vcpu_tb_exec_cb(struct qemu_plugin_tb *tb, qemu_plugin_vcpu_udata_cb_t cb,
                                          enum qemu_plugin_cb_flags flags, void *userdata);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
uint64_t qemu_plugin_tb_vaddr(const struct qemu_plugin_tb *tb);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, qemu_plugin_udata_cb_t cb,
                                    void *userdata);
#define QEMU_PLUGIN_EXPORT __attribute__((visibility("default")))
/* The API version this plugin declares: 1 for QEMU 7.2 (Debian 12); a
 * newer qemu that no longer accepts 1 may take -DSA_QEMU_PLUGIN_VERSION=N
 * (the five functions above are unchanged in later versions). */
#ifndef SA_QEMU_PLUGIN_VERSION
#define SA_QEMU_PLUGIN_VERSION 1
#endif
QEMU_PLUGIN_EXPORT int qemu_plugin_version = SA_QEMU_PLUGIN_VERSION;
/* ---------------------------------------------------------------------------- */

typedef struct {
    uint64_t vaddr;
    uint32_t n;
} block;

static uint64_t begin_addr, end_addr;
static FILE *out;
static int active, windows;

static void on_exec(unsigned int vcpu, void *udata)
{
    (void)vcpu;
    const block *b = udata;
    if (b->vaddr == begin_addr) {
        active = 1;
        fprintf(out, "W %d\n", windows++);
    } else if (b->vaddr == end_addr) {
        active = 0;
    }
    if (active)
        fprintf(out, "%" PRIx64 " %u\n", b->vaddr, b->n);
}

static void on_translate(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    (void)id;
    block *b = malloc(sizeof *b); /* lives as long as the translation; never freed */
    if (!b)
        abort();
    b->vaddr = qemu_plugin_tb_vaddr(tb);
    b->n = (uint32_t)qemu_plugin_tb_n_insns(tb);
    qemu_plugin_register_vcpu_tb_exec_cb(tb, on_exec, QEMU_PLUGIN_CB_NO_REGS, b);
}

static void on_atexit(qemu_plugin_id_t id, void *udata)
{
    (void)id, (void)udata;
    if (out)
        fclose(out);
    out = NULL;
}

QEMU_PLUGIN_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc,
                                           char **argv)
{
    (void)info;
    const char *path = NULL;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strncmp(a, "arg=", 4)) /* the pre-6.0 spelling */
            a += 4;
        if (!strncmp(a, "begin=", 6))
            begin_addr = strtoull(a + 6, NULL, 0);
        else if (!strncmp(a, "end=", 4))
            end_addr = strtoull(a + 4, NULL, 0);
        else if (!strncmp(a, "out=", 4))
            path = a + 4;
    }
    if (!begin_addr || !end_addr || !path) {
        fprintf(stderr, "arm_model_plugin: need begin=, end= and out=\n");
        return -1;
    }
    out = fopen(path, "w");
    if (!out) {
        perror(path);
        return -1;
    }
    qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
    qemu_plugin_register_atexit_cb(id, on_atexit, NULL);
    return 0;
}
