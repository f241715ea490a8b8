# weightstream's whole-model load (the native call weightstream.load makes;
# the model is BF16, which numpy has no type for), cold, timed with its CPU.
import os, sys, time, resource, json
import weightstream
from weightstream import _native
d = sys.argv[1]
r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
tensors, rep = _native.load(d, dirs=None, mirrors=None, route=None, direct=None, names=None, parts=None)
s = time.perf_counter() - t0; r1 = resource.getrusage(resource.RUSAGE_SELF)
n = json.loads(rep)["bytes"]
cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
wheel = open(os.path.dirname(weightstream.__file__) + "-" + weightstream.__version__ + ".dist-info/WHEEL").read()
print(json.dumps({"build": "wheel" if "manylinux" in wheel else "source", "bytes": n, "s": round(s, 4), "gbps": round(n / s / 1e9, 3), "cpu_s_per_gb": round(cpu / (n / 1e9), 4)}))
