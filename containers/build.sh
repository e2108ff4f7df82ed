#!/usr/bin/env bash
# Builds the stages' images from containers/, in one command, on any Linux machine with root,
# debootstrap and bubblewrap (CI, a workstation); copy the images to a cluster from there.
#
#   containers/build.sh [--sandbox|--docker] [pipeline] [summary]     (default: both)
#
#   --sandbox  folders (apptainer build --sandbox) instead of .sif files: no squashfs pass,
#              what the tests use (minutes instead of a quarter of an hour for pipeline.sif)
#   --docker   containers/*.Dockerfile instead, built by buildah into its store below
#              $JAGG_IMAGES/buildah (`buildah push` takes them to a registry or an archive)
#
# Steps, each cached under $JAGG_IMAGES (default ~/.cache/jagg-pipeline/images) and skipped
# when its result exists:
#   1. apptainer: the one on PATH, or else Debian sid's, in a debootstrap'd sid root run
#      through bubblewrap (containers/apptainer.sh, installed as $JAGG_IMAGES/bin/apptainer)
#   2. base-<digest>/: a Debian 12 root (debootstrap minbase) with bash and the venv's Python
#   3. wheels/: every file the locks name, downloaded from PyPI and checked against their hashes
#   4. <digest>/<image>[.sif]: containers/<image>.def on that base, the lock installed from the
#      wheels through envs/install.sh; <digest> covers the recipes, this script, the locks and
#      the installer, so a change to any of them (and nothing else) builds the images anew.
# Prints each image's path, size and build time; the last line of stdout is the image folder.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
images="${JAGG_IMAGES:-${XDG_CACHE_HOME:-$HOME/.cache}/jagg-pipeline/images}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
sandbox=0
docker=0
targets=()
for arg in "$@"; do
    case "$arg" in
        --sandbox) sandbox=1 ;;
        --docker) docker=1 ;;
        pipeline | summary) targets+=("$arg") ;;
        *)
            echo "usage: $0 [--sandbox|--docker] [pipeline] [summary]" >&2
            exit 2
            ;;
    esac
done
[[ ${#targets[@]} -gt 0 ]] || targets=(pipeline summary)

say() { echo "build.sh: $*" >&2; }
need() {
    command -v "$1" >/dev/null || {
        say "$1 is missing: $2"
        exit 1
    }
}
digest() { sha256sum | cut -c1-16; }
# Builds into NAME.partial and renames it on success: an interrupted step leaves no result
# that a rerun would take for a finished one.
finish() { mv "$1.partial" "$1"; }
mkdir -p "$images"
# One build at a time per cache (CI starts one early; the tests' fixture then waits on it).
exec 9>"$images/build.lock"
flock 9

# 1. apptainer
if ! command -v apptainer >/dev/null || [[ "$(command -v apptainer)" == "$images/bin/apptainer" ]]; then
    # squashfuse and fuse3: apptainer mounts a .sif through FUSE (without them it unpacks the
    # whole image into a temporary folder at every exec).
    sid_packages="apptainer,squashfs-tools,squashfuse,fuse3"
    sid="$images/tools/apptainer-sid-$(echo "$sid_packages" | digest)"
    if [[ ! -x "$sid/usr/bin/apptainer" ]]; then
        need debootstrap "apt-get install debootstrap (Debian/Ubuntu), or install Apptainer"
        need bwrap "apt-get install bubblewrap, or install Apptainer"
        say "no apptainer on PATH: Debian sid's, into $sid"
        rm -rf "$sid.partial"
        mkdir -p "$images/tools"
        debootstrap --variant=minbase --include="$sid_packages" sid "$sid.partial" "$mirror" \
            >"$sid.log" 2>&1 || { say "debootstrap failed: see $sid.log"; exit 1; }
        finish "$sid"
    fi
    mkdir -p "$images/bin"
    sed "s|@ROOT@|$sid|" "$repo/containers/apptainer.sh" >"$images/bin/apptainer"
    chmod +x "$images/bin/apptainer"
    export PATH="$images/bin:$PATH"
fi
export JAGG_IMAGES="$images"
say "$(apptainer --version) ($(command -v apptainer))"

# 2. base. Its Python is the venv's interpreter (python3.11 on PATH, as for `make test`, or
# $BASE_PYTHON), copied in: torch's checkpoint metadata pickles an enum, whose pickle differs
# between Python patch releases (3.11.2, Debian's, and 3.11.7 write different bytes), and the
# images are to write what the venv writes. It needs a Python built on Debian 12 (glibc 2.36).
python="$(command -v "${BASE_PYTHON:-python3.11}")" || { say "no ${BASE_PYTHON:-python3.11}"; exit 1; }
python_prefix="$("$python" -c 'import sys; print(sys.base_prefix)')"
python_version="$("$python" -c 'import platform; print(platform.python_version())')"
[[ "$python_version" == 3.11.* ]] || { say "$python is Python $python_version, not 3.11"; exit 1; }
# What CPython's extension modules link to, beyond minbase.
base_packages="bash,ca-certificates,libssl3,libffi8,libsqlite3-0,libncursesw6,libreadline8,"
base_packages+="libgdbm6,libgdbm-compat4,libexpat1,libuuid1"
# The digest names what makes the base: a change to these lines asks for a new one.
base_recipe="bookworm minbase $base_packages, python $python_version from $python_prefix"
base="$images/base-$(echo "$base_recipe, no device nodes, owned by root" | digest)"
if [[ ! -d "$base" ]]; then
    need debootstrap "apt-get install debootstrap"
    say "Debian 12 base with Python $python_version ($python_prefix), into $base"
    rm -rf "$base.partial"
    started=$SECONDS
    debootstrap --variant=minbase --include="$base_packages" bookworm "$base.partial" "$mirror" \
        >"$base.log" 2>&1 || { say "debootstrap failed: see $base.log"; exit 1; }
    # The interpreter and its standard library into /usr/local (not its site-packages).
    into="$base.partial/usr/local"
    cp -a "$python_prefix/bin/python3.11" "$into/bin/"
    ln -s python3.11 "$into/bin/python3"
    cp -a "$python_prefix"/lib/libpython3* "$into/lib/"
    tar -C "$python_prefix/lib" --exclude=python3.11/site-packages --exclude=__pycache__ \
        -c python3.11 | tar -C "$into/lib" -x
    mkdir -p "$into/lib/python3.11/site-packages"
    # Tk and NIS, which nothing here uses, would bring X11's libraries and libnsl.
    rm -f "$into"/lib/python3.11/lib-dynload/{_tkinter,nis}.*.so
    # libpython is found through ld.so's cache (the copied runpath names the old prefix).
    chroot "$base.partial" /sbin/ldconfig
    unresolved="$(chroot "$base.partial" sh -c \
        'ldd /usr/local/bin/python3.11 /usr/local/lib/python3.11/lib-dynload/*.so' | grep "not found" || true)"
    [[ -z "$unresolved" ]] || { say "the copied Python lacks libraries: $unresolved"; exit 1; }
    chroot "$base.partial" /usr/local/bin/python3 -c \
        "import ctypes, hashlib, lzma, bz2, sqlite3, ssl, uuid, venv, ensurepip, zlib" \
        || { say "the copied Python fails in the base"; exit 1; }
    # apt's package lists and downloaded packages are of no use in an image; the device nodes
    # neither (apptainer mounts /dev), and a build in a user namespace cannot copy them.
    rm -rf "$base.partial"/var/cache/apt/archives/*.deb "$base.partial"/var/lib/apt/lists/*
    find "$base.partial/dev" -mindepth 1 -not -type d -delete
    # Everything owned by root: a build in a user namespace that maps root alone (bubblewrap's)
    # cannot give a file another owner (/etc/shadow's group, _apt's folders).
    chown -R --no-dereference 0:0 "$base.partial"
    finish "$base"
    say "base: $((SECONDS - started)) s"
fi

# 3. wheels: one folder for every lock; pip download checks each file against the lock's hashes.
wheels="$images/wheels"
mkdir -p "$wheels"
locks=(requirements.lock requirements-hpsv2.lock requirements-summary.lock)
for lock in "${locks[@]}"; do
    stamp="$wheels/.$(digest <"$repo/$lock").done"
    [[ -f "$stamp" ]] && continue
    say "downloading what $lock names into $wheels"
    python3 -m pip download --quiet --no-deps --require-hashes --dest "$wheels" \
        --requirement "$repo/$lock"
    touch "$stamp"
done
# pip builds the locks' one source distribution (connection-pool, a setup.py project) in an
# isolated environment that asks for setuptools and wheel: with no index in the image, they
# must be here (the venv's install takes the same from PyPI).
[[ -n "$(compgen -G "$wheels/wheel-*.whl")" && -n "$(compgen -G "$wheels/setuptools-*.whl")" ]] \
    || python3 -m pip download --quiet --only-binary :all: --dest "$wheels" setuptools wheel

# 4. images. <digest> covers what goes into them: the recipes, the installer, the locks.
content="$(cd "$repo" && cat containers/*.def containers/*.Dockerfile containers/build.sh \
    envs/install.sh "${locks[@]}" | digest)"
out="$images/$content"
mkdir -p "$out"
pip_offline=(PIP_NO_INDEX=1 PIP_FIND_LINKS=/mnt)

# The builders run where `set -e` does not hold (a `||` list): each step returns on failure.
# containers/TARGET.def -> $out/TARGET (--sandbox) or $out/TARGET.sif
build_apptainer() {
    local image="$1" target="$2" flags=(--build-arg "BASE=$base")
    flags+=(--build-arg "PIP_SETTINGS=PIP_NO_CACHE_DIR=1 ${pip_offline[*]}")
    [[ $sandbox == 1 ]] && flags+=(--sandbox)
    (cd "$repo" && apptainer build --force "${flags[@]}" --bind "$wheels:/mnt" \
        "$image.partial" "containers/$target.def") || return
    finish "$image"
}

# containers/TARGET.Dockerfile -> image jagg-TARGET:<digest> in buildah's store under
# $images/buildah (vfs, chroot isolation: no daemon, no overlay mounts), FROM the base.
buildah_store=(--storage-driver vfs --root "$images/buildah/root" --runroot "$images/buildah/run")
build_docker() {
    local image="$1" target="$2" tag="localhost/jagg-base:${base##*-}" container
    if ! buildah "${buildah_store[@]}" inspect --type image "$tag" >/dev/null 2>&1; then
        tar -C "$base" -cf "$images/buildah/base.tar" . || return
        container="$(buildah "${buildah_store[@]}" from scratch)" || return
        buildah "${buildah_store[@]}" add "$container" "$images/buildah/base.tar" / || return
        buildah "${buildah_store[@]}" commit --rm "$container" "$tag" || return
        rm "$images/buildah/base.tar"
    fi
    local flags=(--build-arg "BASE=$tag")
    for setting in "${pip_offline[@]}"; do flags+=(--build-arg "$setting"); done
    (cd "$repo" && buildah "${buildah_store[@]}" build --isolation chroot "${flags[@]}" \
        --volume "$wheels:/mnt:ro" --file "containers/$target.Dockerfile" \
        --tag "jagg-$target:$content" .) || return
    buildah "${buildah_store[@]}" images --format '{{.Size}}' "jagg-$target:$content" \
        >"$image.partial" || return
    finish "$image"
}

for target in "${targets[@]}"; do
    if [[ $docker == 1 ]]; then
        need buildah "apt-get install buildah"
        mkdir -p "$images/buildah"
        image="$out/$target.docker" kind=docker
    elif [[ $sandbox == 1 ]]; then
        image="$out/$target" kind=apptainer
    else
        image="$out/$target.sif" kind=apptainer
    fi
    if [[ ! -e "$image" ]]; then
        say "building $image"
        rm -rf "$image.partial"
        started=$SECONDS
        "build_$kind" "$image" "$target" >"$image.log" 2>&1 \
            || { say "$kind build failed: see $image.log"; exit 1; }
        echo "$((SECONDS - started))" >"$image.seconds"
    fi
    # Where the workflow looks by default (workflow.containers): `make images` then
    # `snakemake --sdm apptainer` needs no setting.
    [[ $kind == apptainer && $sandbox == 0 ]] && ln -sfn "$image" "$repo/containers/$target.sif"
    if [[ $kind == docker ]]; then
        echo "jagg-$target:$content (buildah) $(cat "$image") built in $(cat "$image.seconds") s"
    else
        echo "$image $(du -sh "$image" | cut -f1) built in $(cat "$image.seconds") s"
    fi
done
echo "$out"
