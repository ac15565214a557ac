"""Transports for the per-step collectives, below the rank side and free of Ray and the
controller: shared memory among the ranks of one host (``shm``); gloo (in engine_ext.elastic.comm)
everywhere else. A group picks one per world from its members' placement."""
