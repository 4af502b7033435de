//go:build linux

package main

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/netns/netnstest"
)

// writeMeshConfig writes the mesh config file where the binary reads it when run in
// workdir: workdir/etc/istio/config/mesh.
func writeMeshConfig(t *testing.T, workdir, yaml string) {
	t.Helper()
	path := filepath.Join(workdir, meshConfigPath)
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
}

// The built binary, in a network namespace of its own and started in a directory holding
// ./etc/istio/config/mesh, moves its admin and stats listeners to the file's
// proxyAdminPort and statsPort, with PROXY_CONFIG's statsPort over the file's; and a file
// that does not parse stops the start, naming the file.
func TestNetnsMeshConfigPorts(t *testing.T) {
	netnstest.Require(t, "curl")
	bin := buildZtunnel(t)
	ns := netnstest.New(t, "meshcfg")
	dir, workdir := t.TempDir(), t.TempDir()
	writeWorkloads(t, dir, nsClientIP, nsServerIP, nsEchoVIP)
	writeMeshConfig(t, workdir, "defaultConfig:\n  proxyAdminPort: 15990\n  statsPort: 15991\n")

	startProcIn(t, workdir, "ztunnel in "+ns.Name, []string{
		"PROXY_MODE=dedicated", "PROXY_WORKLOAD_INFO=default/client/client",
		"LOCAL_XDS_PATH=" + filepath.Join(dir, "workloads.yaml"),
		"CA_PROVIDER=builtin", "CA_DIR=" + filepath.Join(dir, "ca"),
		"OUTBOUND_ADDR=off", "INBOUND_PLAINTEXT_ADDR=off", "INBOUND_ADDR=off", "DNS_PROXY_ADDR=off",
		`PROXY_CONFIG={"statsPort": 15992}`,
	}, "ip", "netns", "exec", ns.Name, bin).waitUntil(t, "ready", 20*time.Second, func() error {
		out, err := ns.Exec("curl", "-fsS", "-m", "1", "http://127.0.0.1:15021/healthz/ready")
		if err != nil {
			return errors.New(string(out))
		}
		return nil
	})
	curl := func(url string) (string, error) {
		out, err := ns.Exec("curl", "-fsS", "-m", "5", url)
		return string(out), err
	}
	if out, err := curl("http://127.0.0.1:15990/config_dump"); err != nil || !strings.Contains(out, `"workloads"`) {
		t.Errorf("admin on proxyAdminPort 15990: %v %.200s", err, out)
	}
	if out, err := curl("http://127.0.0.1:15992/stats/prometheus"); err != nil || !strings.Contains(out, "# TYPE istio_build gauge") {
		t.Errorf("stats on PROXY_CONFIG's statsPort 15992: %v %.200s", err, out)
	}
	for _, port := range []string{"15000", "15020", "15991"} {
		if out, err := curl("http://127.0.0.1:" + port + "/"); err == nil {
			t.Errorf("port %s answered (%.100s); want nothing listening there", port, out)
		}
	}

	t.Run("bad mesh config file", func(t *testing.T) {
		bad := t.TempDir()
		writeMeshConfig(t, bad, "defaultConfig: [\n")
		cmd := exec.Command(bin, "--admin-addr=off")
		cmd.Dir, cmd.Env = bad, []string{raceEnv}
		out, err := cmd.CombinedOutput()
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != 2 || !strings.Contains(string(out), "mesh config file "+meshConfigPath) {
			t.Errorf("start with a bad mesh file: %v %q; want exit status 2 naming %s", err, out, meshConfigPath)
		}
	})
}
