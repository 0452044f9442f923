# --- Histogram: a metric's bucket counts, one observation at a time (serve/metrics.py) ---------
# Rules (the plain model, bisect over the bounds, is tests/models.py's HistogramModel):
# 1. `counts[i]` counts the observations v with bounds[i - 1] < v <= bounds[i] (bisect_left: a
#    value equal to a bound is in that bound's bucket); the last, past every bound, is +Inf.
# 2. `total` sums the observations, `count` counts them.
# 3. `observe` is three calls a call (its duration, first byte and overhead): typed, it costs no
#    Python frame. serve/metrics.py's Histogram adds what reads it.


cdef class Histogram:
    cdef readonly tuple buckets
    cdef readonly list counts  # per bucket, not cumulative; the last is +Inf
    cdef public double total
    cdef public long long count
    cdef double* bounds
    cdef Py_ssize_t size

    def __cinit__(self, tuple buckets):
        self.size = len(buckets)
        self.bounds = <double*> malloc(max(self.size, 1) * sizeof(double))
        if self.bounds == NULL:
            raise MemoryError()
        for index in range(self.size):
            self.bounds[index] = buckets[index]
        self.buckets = buckets
        self.counts = [0] * (self.size + 1)

    def __dealloc__(self):
        free(self.bounds)

    def observe(self, double value):
        cdef Py_ssize_t low = 0, high = self.size, middle
        while low < high:  # bisect_left (rule 1)
            middle = (low + high) >> 1
            if self.bounds[middle] < value:
                low = middle + 1
            else:
                high = middle
        self.counts[low] += 1
        self.total += value
        self.count += 1
