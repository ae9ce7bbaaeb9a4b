"""Every bound on what a package index or an archive may make the probe do.

An index named by ``--index-url`` is someone else's server, and an archive is its bytes: what
they may send and unpack to is bounded, and checked before the bytes are read (a 7 MB sdist
can hold a 4 GB file of zeros). The modules read these at call time, so tests can shrink them.
"""

# -- what an index may send
MAX_PAGE_BYTES = 32 << 20  # PyPI's vllm page: 128 KB for 309 files of 101 versions
MAX_DOWNLOAD_BYTES = 2 << 30  # the sdist is about 50 MB; PyPI's largest vllm file, 509 MB
# A request must bring STALL_BYTES, or its end, every STALL_SECONDS, headers included; a
# socket timeout alone never fires on a server that sends a byte every few seconds.
STALL_SECONDS = 30.0
STALL_BYTES = 64 << 10

# -- what an archive may unpack to
MAX_MEMBER_BYTES = 16 << 20  # one kept file; 0.33.0's largest vllm/*.py is 0.3 MB
MAX_KEPT_BYTES = 512 << 20  # every kept file; 0.33.0's vllm/**/*.py are 44 MB
MAX_KEPT_FILES = 50_000  # 0.33.0 has 2,991
MAX_UNPACKED_BYTES = 4 << 30  # all members of a tar, the skipped ones decompressed too
MAX_TAR_HEADER_BYTES = 1 << 20  # a pax or GNU long-name header, which tarfile reads whole
