#ifndef C_MALLOC_TRIM_H
#define C_MALLOC_TRIM_H

#include <stddef.h>

/// Bytes of the heap in use by the program: glibc's mallinfo2() `uordblks + hblkhd` (arena
/// chunks and mmapped chunks). 0 elsewhere than on glibc.
size_t presence_malloc_in_use_bytes(void);

/// The process's resident memory in bytes (from /proc/self/statm); 0 if it cannot be read.
size_t presence_resident_bytes(void);

/// Gives free pages of every arena back to the system (glibc's malloc_trim(0)); returns whether
/// any memory was released. Does nothing elsewhere than on glibc.
int presence_malloc_trim(void);

#endif
