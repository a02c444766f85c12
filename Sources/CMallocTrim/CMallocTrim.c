#include "CMallocTrim.h"
// Any C library header defines __GLIBC__ on glibc.
#include <stdio.h>
#include <unistd.h>

size_t presence_resident_bytes(void) {
    FILE *file = fopen("/proc/self/statm", "r");
    if (file == NULL) return 0;
    unsigned long size = 0, resident = 0;
    int read = fscanf(file, "%lu %lu", &size, &resident);
    fclose(file);
    if (read != 2) return 0;
    return (size_t)resident * (size_t)sysconf(_SC_PAGESIZE);
}

#if defined(__GLIBC__)
#include <malloc.h>

size_t presence_malloc_in_use_bytes(void) {
    struct mallinfo2 info = mallinfo2();
    return info.uordblks + info.hblkhd;
}

int presence_malloc_trim(void) {
    return malloc_trim(0);
}
#else
size_t presence_malloc_in_use_bytes(void) { return 0; }
int presence_malloc_trim(void) { return 0; }
#endif
