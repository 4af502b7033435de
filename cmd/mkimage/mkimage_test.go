package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/layout"

	"github.com/gozt/gozt/internal/netns/netnstest"
	"github.com/gozt/gozt/internal/testutil"
)

// buildStatic builds the node binary as make image does; env adds to its build environment
// (GOFIPS140=v1.0.0: make image FIPS=1).
func buildStatic(t *testing.T, env ...string) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "ztunnel")
	cmd := exec.Command("go", "build", "-trimpath", "-tags", "grpcnotrace", "-o", bin, "github.com/gozt/gozt/cmd/ztunnel")
	cmd.Env = append(append(os.Environ(), "CGO_ENABLED=0"), env...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// Two builds from the same binary give the same digest and the same docker-archive bytes,
// and the image runs as the chart runs it.
func TestReproducible(t *testing.T) {
	bin := buildStatic(t)
	a, b := t.TempDir(), t.TempDir()
	da, err := build(bin, "gozt/ztunnel:test", "amd64", a)
	if err != nil {
		t.Fatal(err)
	}
	db, err := build(bin, "gozt/ztunnel:test", "amd64", b)
	if err != nil {
		t.Fatal(err)
	}
	if da != db {
		t.Errorf("digests differ: %v and %v", da, db)
	}
	ta, _ := os.ReadFile(filepath.Join(a, "ztunnel.tar"))
	tb, _ := os.ReadFile(filepath.Join(b, "ztunnel.tar"))
	if len(ta) == 0 || !bytes.Equal(ta, tb) {
		t.Errorf("docker-archive tarballs differ (%d and %d bytes)", len(ta), len(tb))
	}

	p, err := layout.FromPath(filepath.Join(a, "oci"))
	if err != nil {
		t.Fatal(err)
	}
	img, err := p.Image(da)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprintf("%v %s %s %s %d", cf.Config.Entrypoint, cf.Config.User, cf.Config.WorkingDir, cf.OS, cf.Created.Unix()); got != "[/ztunnel] 0:1337 / linux 0" {
		t.Errorf("config: entrypoint, user, workdir, os, created = %s", got)
	}
	layers, _ := img.Layers()
	if len(layers) != 1 {
		t.Errorf("%d layers; want 1", len(layers))
	}
}

// The FIPS 140-3 image (make image FIPS=1): its tag must say -fips and another's must not,
// its label names the module, and two builds from the binary give one digest.
func TestFIPSImage(t *testing.T) {
	fipsBin := buildStatic(t, "GOFIPS140=v1.0.0")
	if _, err := build(fipsBin, "gozt/ztunnel:test", "amd64", t.TempDir()); err == nil || !strings.Contains(err.Error(), "must end in -fips") {
		t.Errorf("FIPS build tagged without -fips: %v; want refused", err)
	}
	if _, err := build(buildStatic(t), "gozt/ztunnel:test-fips", "amd64", t.TempDir()); err == nil || !strings.Contains(err.Error(), "not a FIPS 140-3 build") {
		t.Errorf("default build tagged -fips: %v; want refused", err)
	}
	a, b := t.TempDir(), t.TempDir()
	da, err := build(fipsBin, "gozt/ztunnel:test-fips", "amd64", a)
	if err != nil {
		t.Fatal(err)
	}
	if db, err := build(fipsBin, "gozt/ztunnel:test-fips", "amd64", b); err != nil || da != db {
		t.Errorf("digests %v and %v (%v); want one", da, db, err)
	}
	p, err := layout.FromPath(filepath.Join(a, "oci"))
	if err != nil {
		t.Fatal(err)
	}
	img, err := p.Image(da)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if got := cf.Config.Labels[fipsLabel]; !strings.HasPrefix(got, "v1.0.0-") || len(cf.Config.Env) != 1 {
		t.Errorf("label %s = %q, env %v; want the module v1.0.0-... and PATH alone (the binary holds fips140=on)", fipsLabel, got, cf.Config.Env)
	}
}

// TestRunsAsTheChartRunsIt unpacks the image with umoci and runs it with runc the way
// Istio's chart runs the container: args proxy ztunnel, the chart's environment, a read-only
// root, every capability dropped but NET_ADMIN, SYS_ADMIN and NET_RAW, uid 0 gid 1337, /tmp
// an emptyDir. It runs in a fresh network namespace in dedicated mode with a local config
// and the built-in CA; it must turn ready on 15021 and carry one connection SOCKS5 -> HBONE
// (its own 15008) -> an echo server.
func TestRunsAsTheChartRunsIt(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (runc, network namespaces); CI runs as root")
	}
	for _, tool := range []string{"umoci", "runc", "ip"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s (apt-get install umoci runc iproute2; .ci/run installs them)", tool)
		}
	}
	dir := t.TempDir()
	if _, err := build(buildStatic(t), "gozt/ztunnel:test", "amd64", dir); err != nil {
		t.Fatal(err)
	}
	bundle := filepath.Join(dir, "bundle")
	if out, err := exec.Command("umoci", "unpack", "--image", filepath.Join(dir, "oci")+":test", bundle).CombinedOutput(); err != nil {
		t.Fatalf("umoci unpack: %v\n%s", err, out)
	}
	ns := netnstest.New(t, "image")
	examples, err := filepath.Abs("../../examples")
	if err != nil {
		t.Fatal(err)
	}
	// The kubelet mounts the pod's resolv.conf (the DNS proxy reads it) and hosts (localhost
	// for the admin listener) into every container.
	etc := filepath.Join(dir, "etc")
	if err := os.Mkdir(etc, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, content := range map[string]string{"resolv.conf": "nameserver 127.0.0.1\n", "hosts": "127.0.0.1 localhost\n::1 localhost\n"} {
		if err := os.WriteFile(filepath.Join(etc, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	writeSpec(t, filepath.Join(bundle, "config.json"), "/var/run/netns/"+ns.Name, examples, etc)

	// The application behind the workload: an echo server on 127.0.0.1:8080 in the netns.
	var echo net.Listener
	if err := ns.Do(func() (err error) { echo, err = net.Listen("tcp", "127.0.0.1:8080"); return err }); err != nil {
		t.Fatal(err)
	}
	defer echo.Close()
	go serveEcho(echo)

	id := fmt.Sprintf("gozt-test-%d", os.Getpid())
	var out bytes.Buffer
	runc := exec.Command("runc", "run", "--bundle", bundle, id)
	runc.Stdout, runc.Stderr = &out, &out
	if err := runc.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- runc.Wait() }()
	defer func() {
		_ = exec.Command("runc", "kill", id, "KILL").Run()
		_ = exec.Command("runc", "delete", "--force", id).Run()
		if t.Failed() {
			t.Logf("container output:\n%s", out.String())
		}
	}()

	dial := func(addr string) (net.Conn, error) {
		var c net.Conn
		err := ns.Do(func() (err error) { c, err = net.DialTimeout("tcp", addr, 2*time.Second); return err })
		return c, err
	}
	if err := testutil.Poll(30*time.Second, func() error {
		if ready(dial) {
			return nil
		}
		select {
		case err := <-exited:
			t.Fatalf("container exited before it was ready: %v", err)
		default:
		}
		return errors.New("not ready on 15021 within 30s")
	}); err != nil {
		t.Fatal(err)
	}

	checkProcess(t, id)

	c, err := dial("127.0.0.1:15080")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	// SOCKS5: no auth, CONNECT 127.0.0.1:8080.
	c.Write([]byte{5, 1, 0})
	var greet [2]byte
	if _, err := io.ReadFull(c, greet[:]); err != nil || greet != [2]byte{5, 0} {
		t.Fatalf("socks5 greeting: %v %v", greet, err)
	}
	c.Write([]byte{5, 1, 0, 1, 127, 0, 0, 1, 8080 >> 8, 8080 & 0xff})
	var reply [10]byte
	if _, err := io.ReadFull(c, reply[:]); err != nil || reply[1] != 0 {
		t.Fatalf("socks5 connect: reply %v, %v", reply, err)
	}
	msg := []byte("through the image")
	c.Write(msg)
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("echo = %q, %v; want %q", got, err, msg)
	}
	c.Close()

	// SIGTERM (what the kubelet sends) drains and exits 0.
	_ = exec.Command("runc", "kill", id, "TERM").Run()
	select {
	case err := <-exited:
		if err != nil {
			t.Errorf("exit after SIGTERM: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Error("still running 15s after SIGTERM")
	}
	if !strings.Contains(out.String(), "chart variable accepted, not acted on") {
		t.Error("the chart's unused variables were not reported")
	}
}

// ready is a GET of /healthz/ready on 15021 inside the namespace.
func ready(dial func(string) (net.Conn, error)) bool {
	c, err := dial("127.0.0.1:15021")
	if err != nil {
		return false
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	fmt.Fprint(c, "GET /healthz/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
	b, _ := io.ReadAll(c)
	return bytes.HasPrefix(b, []byte("HTTP/1.1 200"))
}

// checkProcess reads the container's process status: gid 1337 and exactly the chart's
// capabilities.
func checkProcess(t *testing.T, id string) {
	t.Helper()
	state, err := exec.Command("runc", "state", id).Output()
	if err != nil {
		t.Fatalf("runc state: %v", err)
	}
	var st struct{ Pid int }
	if err := json.Unmarshal(state, &st); err != nil {
		t.Fatal(err)
	}
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", st.Pid))
	if err != nil {
		t.Fatal(err)
	}
	const want = 1<<12 | 1<<13 | 1<<21 // CAP_NET_ADMIN, CAP_NET_RAW, CAP_SYS_ADMIN
	for _, line := range strings.Split(string(status), "\n") {
		k, v, _ := strings.Cut(line, ":")
		v = strings.TrimSpace(v)
		switch k {
		case "Uid", "Gid":
			if f := strings.Fields(v); len(f) == 0 || f[0] != map[string]string{"Uid": "0", "Gid": "1337"}[k] {
				t.Errorf("%s = %s", k, v)
			}
		case "CapEff", "CapBnd":
			if v != fmt.Sprintf("%016x", want) {
				t.Errorf("%s = %s; want %016x", k, v, want)
			}
		}
	}
}

func serveEcho(l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			io.Copy(c, c)
		}()
	}
}

// writeSpec edits umoci's runtime spec into the chart's container: args, env, read-only
// root, capabilities, the test's network namespace, /tmp as an emptyDir, and the local
// config, resolv.conf and hosts mounted read-only.
func writeSpec(t *testing.T, path, netnsPath, examples, etc string) {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var spec map[string]any
	if err := json.Unmarshal(raw, &spec); err != nil {
		t.Fatal(err)
	}
	proc := spec["process"].(map[string]any)
	proc["terminal"] = false
	proc["args"] = []string{"/ztunnel", "proxy", "ztunnel"}
	proc["env"] = []string{
		"PATH=/",
		// What the chart sets (values at their defaults).
		"RUST_LOG=info", "RUST_BACKTRACE=1", "ISTIO_META_CLUSTER_ID=Kubernetes", "INPOD_ENABLED=true",
		"TERMINATION_GRACE_PERIOD_SECONDS=30", "POD_NAME=ztunnel-test", "POD_NAMESPACE=istio-system",
		"NODE_NAME=local", "INSTANCE_IP=127.0.0.1", "SERVICE_ACCOUNT=ztunnel", "ISTIO_META_ENABLE_HBONE=true",
		"ZTUNNEL_CPU_LIMIT=2",
		// Standalone instead of istiod: the local config and the built-in CA.
		"PROXY_MODE=dedicated", "PROXY_WORKLOAD_INFO=default/local/default",
		"LOCAL_XDS_PATH=/etc/gozt/localhost.yaml", "XDS_ADDRESS=", "CA_ADDRESS=",
		"CA_PROVIDER=builtin", "CA_DIR=/tmp/ca", "UNSTABLE_ENABLE_SOCKS5=true",
	}
	caps := []string{"CAP_NET_ADMIN", "CAP_SYS_ADMIN", "CAP_NET_RAW"}
	proc["capabilities"] = map[string]any{"bounding": caps, "effective": caps, "permitted": caps}
	proc["noNewPrivileges"] = false // allowPrivilegeEscalation: true
	spec["root"] = map[string]any{"path": "rootfs", "readonly": true}
	spec["mounts"] = append(spec["mounts"].([]any),
		map[string]any{"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": []string{"nosuid", "nodev", "mode=1777"}},
		map[string]any{"destination": "/etc/gozt", "type": "bind", "source": examples, "options": []string{"rbind", "ro"}},
		map[string]any{"destination": "/etc/resolv.conf", "type": "bind", "source": filepath.Join(etc, "resolv.conf"), "options": []string{"bind", "ro"}},
		map[string]any{"destination": "/etc/hosts", "type": "bind", "source": filepath.Join(etc, "hosts"), "options": []string{"bind", "ro"}},
	)
	linux := spec["linux"].(map[string]any)
	var nss []any
	for _, n := range linux["namespaces"].([]any) {
		if n.(map[string]any)["type"] == "network" {
			n = map[string]any{"type": "network", "path": netnsPath}
		}
		nss = append(nss, n)
	}
	linux["namespaces"] = nss
	out, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, out, 0o644); err != nil {
		t.Fatal(err)
	}
}
