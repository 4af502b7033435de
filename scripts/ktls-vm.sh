#!/bin/sh
# Runs the kernel TLS tests inside a VM whose kernel has kernel TLS (this repo's hosts
# lack CONFIG_TLS): static test binaries, busybox and the tls module with the crypto
# modules it asks for go into an initramfs; qemu boots the installed Debian cloud kernel
# on it with software emulation (no KVM, no network: the tests use loopback), the tests
# print to the serial console, the VM powers off. Exit status: 0 if every binary passed.
#
# KTLS_VM_TESTS lists package:test-regex pairs (default: all of internal/ktls, and the
# kernel TLS tests of hbone and proxy); extra arguments go to every binary after them.
# KTLS_VM_ZBENCH, if set, names zbench suite cases (e.g. throughput/1,rr) run after the
# tests on the ztunnel and ztunnel-ktls paths: a check that the suite's kernel TLS path
# works, not a measurement (the guest is emulated).
#
#   apt-get install -y qemu-system-x86 busybox-static linux-image-cloud-amd64
#   scripts/ktls-vm.sh [go test flags, e.g. -test.run KeyUpdate]
set -eu
TESTS=${KTLS_VM_TESTS:-"internal/ktls:. hbone:KernelTLS proxy:KernelTLS"}

KVER=${KVER:-$(ls /lib/modules | grep -- '-cloud-amd64$' | sort -V | tail -n 1)}
KERNEL=/boot/vmlinuz-$KVER
MODDIR=/lib/modules/$KVER
BUSYBOX=${BUSYBOX:-/bin/busybox}
WORK=${WORK:-.tmp/ktls-vm}
for f in "$KERNEL" "$MODDIR/modules.dep" "$BUSYBOX"; do
	[ -r "$f" ] || { echo "ktls-vm: $f missing (apt-get install -y qemu-system-x86 busybox-static linux-image-cloud-amd64)" >&2; exit 2; }
done
command -v qemu-system-x86_64 >/dev/null || { echo "ktls-vm: qemu-system-x86_64 missing" >&2; exit 2; }

rm -rf "$WORK"
mkdir -p "$WORK/root/bin" "$WORK/root/proc" "$WORK/root/sys" "$WORK/root/dev" "$WORK/root/tmp" "$WORK/root/mod"
mkdir -p "$WORK/root/tests"
: > "$WORK/root/tests/list"
for spec in $TESTS; do
	pkg=${spec%%:*}
	name=$(basename "$pkg")
	CGO_ENABLED=0 go test -c -o "$WORK/root/tests/$name.test" "./$pkg"
	echo "$name ${spec#*:}" >> "$WORK/root/tests/list"
done
cp "$BUSYBOX" "$WORK/root/bin/busybox"
if [ -n "${KTLS_VM_ZBENCH:-}" ]; then
	CGO_ENABLED=0 go build -tags grpcnotrace -o "$WORK/root/bin/ztunnel" ./cmd/ztunnel
	CGO_ENABLED=0 go build -o "$WORK/root/bin/zbench" ./cmd/zbench
	echo "$KTLS_VM_ZBENCH" > "$WORK/root/zbench"
	mkdir -p "$WORK/root/etc"
	echo "nameserver 127.0.0.1" > "$WORK/root/etc/resolv.conf" # the nodes' DNS proxy reads it
fi
# The proxy tests read ../examples from their working directory, /tmp.
cp -r examples "$WORK/root/examples"

# tls.ko and the crypto the kernel requests when keys are installed (gcm(aes),
# rfc7539(chacha20,poly1305)), each after its dependencies: modules.dep lists a module's
# dependencies so that loading them from the end backwards works. Built-in ones are absent.
: > "$WORK/root/mod/order"
for m in tls ctr gcm ghash-generic ghash-clmulni-intel aesni-intel chacha_generic chacha-x86_64 poly1305_generic poly1305-x86_64 chacha20poly1305; do
	line=$(grep -E "(^|/)$m\.ko:" "$MODDIR/modules.dep" || true)
	[ -n "$line" ] || continue
	for p in $(echo "$line" | tr -d : | awk '{ for (i = NF; i > 1; i--) print $i; print $1 }'); do
		grep -qx "$p" "$WORK/root/mod/order" && continue
		mkdir -p "$WORK/root/mod/$(dirname "$p")"
		cp "$MODDIR/$p" "$WORK/root/mod/$p"
		echo "$p" >> "$WORK/root/mod/order"
	done
done

cat > "$WORK/root/init" <<INIT
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
ip link set lo up
# Large socket buffers may be asked for (the zero-copy tests keep their sinks from filling).
echo 67108864 > /proc/sys/net/core/wmem_max
echo 67108864 > /proc/sys/net/core/rmem_max
for m in \$(cat /mod/order); do insmod /mod/\$m 2>/dev/null || echo "ktls-vm: insmod \$m failed"; done
cd /tmp
echo "ktls-vm: booted in \$(cut -d' ' -f1 /proc/uptime) s, kernel \$(uname -r)"
set -f
code=0
while read name run; do
	echo "ktls-vm: \$name.test -test.run \$run"
	(cd /tmp && /tests/\$name.test -test.v -test.count=1 -test.timeout=8m -test.run "\$run" \$(cat /args) </dev/null) || code=1
done < /tests/list
if [ -s /zbench ]; then
	echo "ktls-vm: zbench suite --only \$(cat /zbench)"
	/bin/zbench suite --short --no-capture --repo / --ztunnel /bin/ztunnel --only "\$(cat /zbench)" </dev/null || code=1
fi
echo "KTLS-VM-EXIT=\$code"
poweroff -f
INIT
chmod +x "$WORK/root/init"
echo "$*" > "$WORK/root/args" # split on spaces in the guest, never run as shell code
(cd "$WORK/root" && find . | cpio -o -H newc --quiet) | gzip -1 > "$WORK/initramfs.gz"

start=$(date +%s)
timeout 600 qemu-system-x86_64 -accel tcg -cpu max -smp 2 -m 1024 -nographic -no-reboot \
	-kernel "$KERNEL" -initrd "$WORK/initramfs.gz" \
	-append "console=ttyS0 quiet panic=-1 rdinit=/init" < /dev/null | tee "$WORK/console.log"
echo "ktls-vm: $(($(date +%s) - start)) s, boot to power-off"
code=$(tr -d '\r' < "$WORK/console.log" | sed -n 's/^KTLS-VM-EXIT=\([0-9]*\)$/\1/p' | tail -n 1)
[ -n "$code" ] || { echo "ktls-vm: the tests did not finish" >&2; exit 1; }
exit "$code"
