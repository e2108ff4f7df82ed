#!/usr/bin/env bash
# `apptainer` for a machine whose distribution has no Apptainer package (Debian 12): Debian
# sid's apptainer, run from a debootstrap'd sid root through bubblewrap. containers/build.sh
# installs this script as $JAGG_IMAGES/bin/apptainer, with ROOT below set to that root; put
# that folder first on PATH and `apptainer build|exec` and `snakemake --sdm apptainer` use it.
#
# bubblewrap shows the sid root as / and binds into it what a command names from the host:
# /tmp, the working folder, $HOME, the image cache, every --bind/-B source and every
# APPTAINER_BIND source (what Snakemake and the workflow pass) and every absolute path given
# as an argument (an image, a definition file, a build's destination).
set -euo pipefail

root="${JAGG_APPTAINER_ROOT:-@ROOT@}"
if [[ ! -x "$root/usr/bin/apptainer" ]]; then
    echo "$0: no apptainer in $root: run containers/build.sh (it builds that root)" >&2
    exit 1
fi

binds=()
bind() {
    local path="$1"
    # The host side of src[:dest[:opts]], made absolute; only what exists can be bound.
    path="${path%%:*}"
    [[ -n "$path" && -e "$path" ]] || return 0
    path="$(realpath "$path")"
    case "$path" in
        / | /proc* | /sys* | /dev*) return 0 ;;
    esac
    binds+=(--bind "$path" "$path")
}

for path in /tmp "$PWD" "${HOME:-}" "${JAGG_IMAGES:-}" /etc/hosts /etc/resolv.conf; do
    bind "$path"
done
previous=""
for arg in "$@"; do
    if [[ "$previous" == "--bind" || "$previous" == "-B" ]]; then
        IFS=, read -ra specs <<<"$arg"
        for spec in "${specs[@]}"; do bind "$spec"; done
    elif [[ "$arg" == /* ]]; then
        # A build's destination does not exist yet: its folder does.
        if [[ -e "$arg" ]]; then bind "$arg"; else bind "$(dirname "$arg")"; fi
    fi
    previous="$arg"
done
IFS=, read -ra specs <<<"${APPTAINER_BIND:-}"
for spec in "${specs[@]}"; do bind "$spec"; done

as_root=()
if [[ "$(id -u)" == 0 ]]; then
    # A root whose bounding set lacks capabilities that apptainer's build needs
    # (CAP_SYS_RESOURCE here) gets them all back inside a user namespace of its own.
    as_root=(--unshare-user --uid 0 --gid 0 --cap-add ALL)
fi

exec bwrap --bind "$root" / --dev-bind /dev /dev --bind /proc /proc --bind /sys /sys \
    "${as_root[@]}" "${binds[@]}" --chdir "$PWD" /usr/bin/apptainer "$@"
