"""Pack Transformer Engine for the device machines, here (with a network), into .te/ (ignored, carried).

The device images have no TE and reach no package index, and a call carries at most 64 MiB. TE's PyPI wheels:
transformer_engine (python, 1 MiB), transformer_engine_torch (a source distribution: the PyTorch extension,
built on the device by te_build.sh against the device's torch) and transformer_engine_cu13 (python code plus the
prebuilt core library, 264 MiB: libtransformer_engine.so carries cubins for sm_75 ... sm_120). An H100/H200 loads
only the sm_90 cubins, so this script zeroes the payload of every other architecture's cubin in the library's
fatbinaries (headers and layout untouched, so nothing moves and the sm_90 images stay byte-identical) and packs the
result with xz: about 26 MiB. The JAX half and nothing else is dropped.

    python benchmarks/device/te_pack.py [--version 2.20.2] [--arch 90]

Writes .te/te-core-sm<arch>.tar.xz, .te/transformer_engine-<v>-py3-none-any.whl, .te/wheels/ (TE's python
dependencies the device lacks) and .te/build/ (what only the extension's build needs: its source distribution and
the cuDNN frontend, for its headers).
"""
import argparse
import glob
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)
PY_DEPS = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions",
           "nvdlfw-inspect")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def keep_one_arch(library, arch):
    """Zero, in place, the payload of every fatbinary entry (cubin or PTX) whose architecture is not `arch`.
    Returns (fatbinaries, bytes kept, bytes zeroed). Raises if a fatbinary has no entry for `arch`."""
    data = bytearray(open(library, "rb").read())
    start, fatbins, kept, zeroed = 0, 0, 0, 0
    while (at := data.find(FATBIN_MAGIC, start)) >= 0:
        _version, header, size = struct.unpack_from("<HHQ", data, at + 4)
        if header != 16:                      # not a fatbinary header: the magic inside other bytes
            start = at + 4
            continue
        fatbins += 1
        entry, end, found = at + header, at + header + size, False
        while entry < end:
            _kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            entry_arch = struct.unpack_from("<I", data, entry + 28)[0]
            if entry_arch == arch:
                kept, found = kept + payload, True
            else:
                data[entry + entry_header:entry + entry_header + payload] = bytes(payload)
                zeroed += payload
            entry += entry_header + payload
        if not found:
            raise SystemExit(f"{library}: a fatbinary at {at:#x} has no sm_{arch} image")
        start = end
    open(library, "wb").write(data)
    return fatbins, kept, zeroed


def pip_download(dest, *names, binary=True):
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", dest, *names]
    if binary:
        cmd += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
        for p in PLATFORMS:
            cmd += ["--platform", p]
    subprocess.run(cmd, check=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", default="2.20.2")
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    out = os.path.join(ROOT, ".te")
    for sub in ("wheels", "build"):
        os.makedirs(os.path.join(out, sub), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        pip_download(tmp, f"transformer-engine-cu13=={args.version}", f"transformer-engine=={args.version}")
        pip_download(tmp, f"transformer-engine-torch=={args.version}", binary=False)
        core = glob.glob(os.path.join(tmp, "transformer_engine_cu13-*.whl"))[0]
        tree = os.path.join(tmp, "core")
        zipfile.ZipFile(core).extractall(tree)
        shutil.rmtree(os.path.join(tree, "transformer_engine", "jax"))
        fatbins, kept, zeroed = keep_one_arch(
            os.path.join(tree, "transformer_engine", "wheel_lib", "libtransformer_engine.so"), args.arch)
        print(f"{fatbins} fatbinaries: sm_{args.arch} {kept / 2**20:.1f} MiB kept, others {zeroed / 2**20:.1f} MiB "
              "zeroed")
        packed = os.path.join(out, f"te-core-sm{args.arch}.tar.xz")
        with tarfile.open(packed, "w:xz", preset=9) as tar:
            for name in sorted(os.listdir(tree)):
                tar.add(os.path.join(tree, name), arcname=name)
        print(f"{packed}: {os.path.getsize(packed) / 2**20:.1f} MiB")
        shutil.copy(glob.glob(os.path.join(tmp, "transformer_engine-*.whl"))[0], out)
        shutil.copy(glob.glob(os.path.join(tmp, "transformer_engine_torch-*.tar.gz"))[0], os.path.join(out, "build"))
    pip_download(os.path.join(out, "wheels"), *PY_DEPS)
    pip_download(os.path.join(out, "build"), "nvidia-cudnn-frontend")


if __name__ == "__main__":
    main()
