/* A scripted stand-in for libcuda.so.1, built by the tests with gcc. It exports the entry
 * points gpu/cuda binds, keeps a checkpoint state per registered PID, validates the argument
 * structures (reserved fields zero, pair pointers and counts) and records what it was given.
 * Build with -DNO_CHECKPOINT for a driver older than 570 (no cuCheckpoint* symbols).
 * Control: fake_* functions, called by the test through purego. */
#include <stdint.h>
#include <string.h>

typedef int CUresult;
enum { OK = 0, INVALID_VALUE = 1, NOT_INITIALIZED = 3, ILLEGAL_STATE = 401, NOT_FOUND = 500, NOT_SUPPORTED = 801, TIMEOUT = 909 };

typedef struct { unsigned char bytes[16]; } CUuuid;
typedef struct { CUuuid oldUuid; CUuuid newUuid; } CUcheckpointGpuPair;
typedef struct { unsigned int timeoutMs; unsigned int reserved0; uint64_t reserved1[7]; } CUcheckpointLockArgs;
typedef struct { uint64_t reserved[8]; } CUcheckpointCheckpointArgs;
typedef struct { uint64_t reserved[8]; } CUcheckpointUnlockArgs;
typedef struct {
	CUcheckpointGpuPair *gpuPairs;
	unsigned int gpuPairsCount;
	char reserved[52 - sizeof(CUcheckpointGpuPair *)];
	uint64_t reserved1;
} CUcheckpointRestoreArgs;

#define MAXP 16
static int inited, init_calls, cuda_version = 12080, init_result;
static int pids[MAXP], states[MAXP], forced[MAXP][8], npids;
static unsigned int last_timeout;
static unsigned int last_pairs;
static CUcheckpointGpuPair pairs[8];

/* layout, as this C compiler sees it */
int fake_sizeof(int which) {
	switch (which) {
	case 0: return sizeof(CUcheckpointLockArgs);
	case 1: return sizeof(CUcheckpointCheckpointArgs);
	case 2: return sizeof(CUcheckpointRestoreArgs);
	case 3: return sizeof(CUcheckpointUnlockArgs);
	case 4: return sizeof(CUcheckpointGpuPair);
	case 5: return (int)__builtin_offsetof(CUcheckpointRestoreArgs, gpuPairsCount);
	case 6: return (int)__builtin_offsetof(CUcheckpointRestoreArgs, reserved);
	case 7: return (int)__builtin_offsetof(CUcheckpointRestoreArgs, reserved1);
	case 8: return (int)__builtin_offsetof(CUcheckpointLockArgs, reserved1);
	}
	return -1;
}
void fake_set_cuda_version(int v) { cuda_version = v; }
void fake_set_init_result(int r) { init_result = r; }
int fake_init_calls(void) { return init_calls; }
void fake_add_process(int pid) { pids[npids] = pid; states[npids] = 0; memset(forced[npids], 0, sizeof forced[npids]); npids++; }
/* step: 0 state, 1 tid, 2 lock, 3 checkpoint, 4 restore, 5 unlock */
void fake_force(int pid, int step, int result) {
	for (int i = 0; i < npids; i++) if (pids[i] == pid) forced[i][step] = result;
}
unsigned int fake_last_timeout_ms(void) { return last_timeout; }
unsigned int fake_last_pair_count(void) { return last_pairs; }
int fake_last_pair_byte(int pair, int which, int b) { return which ? pairs[pair].newUuid.bytes[b] : pairs[pair].oldUuid.bytes[b]; }

__attribute__((unused)) static int zero(const void *p, size_t n) { const unsigned char *c = p; for (size_t i = 0; i < n; i++) if (c[i]) return 0; return 1; }
__attribute__((unused)) static int find(int pid) { for (int i = 0; i < npids; i++) if (pids[i] == pid) return i; return -1; }

CUresult cuInit(unsigned int flags) { init_calls++; if (flags) return INVALID_VALUE; if (init_result) return init_result; inited = 1; return OK; }
CUresult cuDriverGetVersion(int *v) { *v = cuda_version; return OK; }
CUresult cuGetErrorName(CUresult r, const char **s) {
	switch (r) {
	case INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; return OK;
	case ILLEGAL_STATE: *s = "CUDA_ERROR_ILLEGAL_STATE"; return OK;
	case NOT_FOUND: *s = "CUDA_ERROR_NOT_FOUND"; return OK;
	case TIMEOUT: *s = "CUDA_ERROR_TIMEOUT"; return OK;
	case NOT_SUPPORTED: *s = "CUDA_ERROR_NOT_SUPPORTED"; return OK;
	case NOT_INITIALIZED: *s = "CUDA_ERROR_NOT_INITIALIZED"; return OK;
	}
	*s = 0; return INVALID_VALUE;
}
CUresult cuGetErrorString(CUresult r, const char **s) {
	const char *n; if (cuGetErrorName(r, &n)) { *s = 0; return INVALID_VALUE; }
	*s = "fake driver says so"; return OK;
}

#ifndef NO_CHECKPOINT
/* common prologue: driver initialised, PID known, no forced result */
#define PRO(step) \
	if (!inited) return NOT_INITIALIZED; \
	int i = find(pid); if (i < 0) return (step) == 0 ? INVALID_VALUE : NOT_FOUND; \
	if (forced[i][step]) return forced[i][step];

CUresult cuCheckpointProcessGetState(int pid, int *state) { PRO(0) *state = states[i]; return OK; }
CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) { PRO(1) *tid = pid + 7; return OK; }
CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *a) {
	PRO(2)
	if (a) { if (a->reserved0 || !zero(a->reserved1, sizeof a->reserved1)) return INVALID_VALUE; last_timeout = a->timeoutMs; }
	if (states[i] != 0) return ILLEGAL_STATE;
	states[i] = 1; return OK;
}
CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *a) {
	PRO(3)
	if (a && !zero(a, sizeof *a)) return INVALID_VALUE;
	if (states[i] != 1) return ILLEGAL_STATE;
	states[i] = 2; return OK;
}
CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *a) {
	PRO(4)
	last_pairs = 0;
	if (a) {
		if (!zero(a->reserved, sizeof a->reserved) || a->reserved1) return INVALID_VALUE;
		if ((a->gpuPairs == 0) != (a->gpuPairsCount == 0) || a->gpuPairsCount > 8) return INVALID_VALUE;
		last_pairs = a->gpuPairsCount;
		for (unsigned int k = 0; k < a->gpuPairsCount; k++) pairs[k] = a->gpuPairs[k];
	}
	if (states[i] != 2) return ILLEGAL_STATE;
	states[i] = 1; return OK;
}
CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *a) {
	PRO(5)
	if (a && !zero(a, sizeof *a)) return INVALID_VALUE;
	if (states[i] != 1) return ILLEGAL_STATE;
	states[i] = 0; return OK;
}
#endif
