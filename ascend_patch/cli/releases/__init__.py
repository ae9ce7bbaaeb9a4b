"""Getting at the vLLM source a probe reads: a release from a package index, a local wheel or
sdist, a source tree or an installed ``site-packages``.

A version is fetched as its sdist (30–50 MB, against about 340 MB for the wheel) from the
index's simple API, checked against the sha256 the index publishes, and only its
``vllm/**/*.py`` files are kept in the cache (``ascend_patch.env.cache_dir()``
``/releases``), so a second probe of the same release needs no network. ``pip download`` is
not used: it insists on building an sdist, which vLLM's cannot do without CUDA.

An index is not trusted: its pages and files are streamed under size limits and a stall
deadline, the file name it gives must be a plain name, and an archive is unpacked under
limits too. A cache entry records the sha256 of every file it holds and is reused only while
they all match; otherwise it is fetched again and replaced. One concern per module:

- :mod:`.sources`: an argument to a :class:`Source` (the entry points, re-exported here);
- :mod:`.index`: the project page on a simple-API index, and which file of a release to fetch;
- :mod:`.transport`: HTTP(S) under size limits and a stall deadline;
- :mod:`.archive`: a wheel's or sdist's ``vllm/**/*.py``, safely unpacked;
- :mod:`.cache`: the locked cache of extracted releases;
- :mod:`.versions`: the version a file name, its metadata or a tree declares;
- :mod:`.limits`: every bound on what an index or an archive may make the probe do;
- :mod:`.messages`: :class:`ProbeError` and the probe's lines on stderr.
"""

from ascend_patch.cli.releases.index import DEFAULT_INDEX
from ascend_patch.cli.releases.messages import ProbeError
from ascend_patch.cli.releases.sources import Source, fetch_release, open_source

__all__ = ["DEFAULT_INDEX", "ProbeError", "Source", "fetch_release", "open_source"]
