"""Tags a built fusedce wheel with the torch it was compiled against, as flash-attn's wheels are
tagged: the local version label names torch's major.minor and its CUDA (or cpu), and the
dependency on torch is narrowed to that minor version, because the extension links torch's C++
ABI, which changes between minor versions. Rewrites METADATA, renames the .dist-info and
regenerates RECORD; prints the new wheel's path.

    python scripts/tag_wheel.py WHEEL    (torch: the importing interpreter's)
"""

import base64
import hashlib
import os
import re
import sys
import zipfile

import torch


def torch_label():
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    compute = "cu" + torch.version.cuda.replace(".", "") if torch.version.cuda else "cpu"
    return f"torch{major}.{minor}{compute}", f"{major}.{minor}"


def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def retag(path):
    label, torch_minor = torch_label()
    folder, filename = os.path.split(path)
    dist, version, rest = filename.split("-", 2)
    if "+" in version:
        raise SystemExit(f"{filename} already carries a local version label")
    new_version = f"{version}+{label}"
    old_info, new_info = f"{dist}-{version}.dist-info/", f"{dist}-{new_version}.dist-info/"
    with zipfile.ZipFile(path) as src:
        entries = [(info, src.read(info)) for info in src.infolist()]
    out_path = os.path.join(folder, f"{dist}-{new_version}-{rest}")
    records = []
    with zipfile.ZipFile(out_path, "w", zipfile.ZIP_DEFLATED) as dst:
        for info, data in entries:
            name = info.filename.replace(old_info, new_info, 1)
            if name == new_info + "RECORD":
                continue
            if name == new_info + "METADATA":
                text = data.decode()
                text = re.sub(r"^Version: .*$", f"Version: {new_version}", text, count=1, flags=re.M)
                text, n = re.subn(r"^Requires-Dist: torch\b[^;\n]*", f"Requires-Dist: torch=={torch_minor}.*",
                                  text, flags=re.M)
                if n != 1:
                    raise SystemExit("METADATA has no single Requires-Dist on torch")
                data = text.encode()
            zinfo = zipfile.ZipInfo(name, info.date_time)
            zinfo.external_attr = info.external_attr
            zinfo.compress_type = zipfile.ZIP_DEFLATED
            dst.writestr(zinfo, data)
            records.append(record_line(name, data))
        records.append(f"{new_info}RECORD,,")
        dst.writestr(new_info + "RECORD", "\n".join(records) + "\n")
    os.remove(path)
    return out_path


if __name__ == "__main__":
    print(retag(sys.argv[1]))
