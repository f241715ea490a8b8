// Faults in fresh anonymous memory for SECONDS on NTHREADS threads (THP
// advised), 256 MiB mappings populated with MADV_POPULATE_WRITE and
// unmapped; prints GB/s faulted.
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include "../clock.h"
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
static double secs, t0;
static void *run(void *arg){
  size_t len=256ul<<20; unsigned long *bytes=arg;
  while(now()-t0<secs){
    char *p=mmap(0,len,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
    if(p==MAP_FAILED){perror("mmap");exit(1);}
    madvise(p,len,MADV_HUGEPAGE);
    if(madvise(p,len,MADV_POPULATE_WRITE)){perror("populate");exit(1);}
    munmap(p,len); *bytes+=len;
  }
  return 0;
}
int main(int c,char**v){
  secs=atof(v[1]); int n=atoi(v[2]); pthread_t th[64]; unsigned long b[64]={0};
  t0=now();
  for(int i=0;i<n;i++) pthread_create(&th[i],0,run,&b[i]);
  unsigned long tot=0; for(int i=0;i<n;i++){pthread_join(th[i],0); tot+=b[i];}
  printf("%.3f\n", tot/1e9/(now()-t0));
}
