#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <pthread.h>
#include <unistd.h>
#include <stdio.h>
static void *f(void *a) { for (;;) sleep(100); return 0; }
int main(int argc, char **argv) {
  struct sock_filter insns[] = { BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW) };
  struct sock_fprog prog = { .len = 1, .filter = insns };
  pthread_t t;
  if (argc > 1) pthread_create(&t, 0, f, 0); /* a thread before the filter */
  prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
  if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)) perror("seccomp");
  for (int i = 0; i < 3; i++) pthread_create(&t, 0, f, 0);
  printf("ready\n"); fflush(stdout);
  for (;;) sleep(100);
}
