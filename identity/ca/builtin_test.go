package ca_test

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/ca/catest"
)

// TestBuiltinSharedDir: several instances starting at once on one directory end up with one
// root, the key is private, and a restart reuses it.
func TestBuiltinSharedDir(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "cacerts")
	const n = 8
	cas := make([]*ca.Builtin, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { cas[i], errs[i] = ca.NewBuiltin(dir, time.Hour) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("instance %d: %v", i, err)
		}
	}
	root := cas[0].Roots()[0]
	for i, c := range cas {
		if r := c.Roots(); len(r) != 1 || !r[0].Equal(root) {
			t.Errorf("instance %d has a different root", i)
		}
	}
	st, err := os.Stat(filepath.Join(dir, ca.CAKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Errorf("%s mode = %v; want 0600", ca.CAKeyFile, st.Mode().Perm())
	}
	for _, f := range []string{ca.CACertFile, ca.RootCertFile, ca.CertChainFile} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Errorf("layout file: %v", err)
		}
	}
	leftovers, _ := filepath.Glob(filepath.Join(dir, ".*"))
	if len(leftovers) != 0 {
		t.Errorf("temporary files left behind: %v", leftovers)
	}

	restarted, err := ca.NewBuiltin(dir, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if !restarted.Roots()[0].Equal(root) {
		t.Error("restart generated a new root")
	}
	// Leaves from one instance verify against the root another one loaded.
	iss, err := cas[3].Fetch(context.Background(), idA)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(restarted.Roots()[0])
	if _, err := iss.Certificate.Leaf.Verify(x509.VerifyOptions{Roots: pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Errorf("leaf does not verify against the shared root: %v", err)
	}
	if life := iss.NotAfter.Sub(iss.NotBefore); life != time.Hour {
		t.Errorf("leaf lifetime = %v; want SECRET_TTL 1h", life)
	}
	if got, _ := iss.Identity(); got != idA {
		t.Errorf("leaf identity = %v; want %v", got, idA)
	}
}

// TestBuiltinPluggedCerts reads Istio's cacerts layout with an intermediate CA: leaves carry
// the intermediate and chain to the root in root-cert.pem.
func TestBuiltinPluggedCerts(t *testing.T) {
	root := catest.NewRoot(t, "root")
	inter := root.Intermediate(t, "intermediate", time.Now().Add(-time.Hour), time.Now().Add(48*time.Hour))
	dir := inter.WriteCACerts(t)
	c, err := ca.NewBuiltin(dir, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	iss, err := c.Fetch(context.Background(), idB)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(iss.Certificate.Certificate); n != 2 {
		t.Errorf("chain has %d certificates; want leaf + intermediate", n)
	}
	if len(iss.Roots) != 1 || !iss.Roots[0].Equal(root.Cert) {
		t.Error("roots are not root-cert.pem")
	}

	// A key that does not match ca-cert.pem is refused with a message naming the files.
	other := catest.NewRoot(t, "other")
	keyDER, _ := x509.MarshalECPrivateKey(other.Key)
	os.WriteFile(filepath.Join(dir, ca.CAKeyFile), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600)
	if _, err := ca.NewBuiltin(dir, time.Hour); err == nil {
		t.Error("mismatched ca-key.pem accepted")
	}
}

// TestBuiltinSharedDirProcesses starts several processes (this test binary) on one empty
// directory at once, as several nodes sharing a volume would; all must load the same root.
func TestBuiltinSharedDirProcesses(t *testing.T) {
	if dir := os.Getenv("GOZT_TEST_CA_DIR"); dir != "" {
		c, err := ca.NewBuiltin(dir, time.Hour)
		if err != nil {
			fmt.Println("error:", err)
			os.Exit(1)
		}
		fmt.Printf("root=%s\n", c.Roots()[0].SerialNumber)
		os.Exit(0)
	}
	dir := filepath.Join(t.TempDir(), "shared")
	const n = 4
	outs := make([]string, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			cmd := exec.Command(os.Args[0], "-test.run=^TestBuiltinSharedDirProcesses$")
			cmd.Env = append(os.Environ(), "GOZT_TEST_CA_DIR="+dir)
			out, err := cmd.Output()
			outs[i], errs[i] = strings.TrimSpace(string(out)), err
		})
	}
	wg.Wait()
	for i := range n {
		if errs[i] != nil || !strings.HasPrefix(outs[i], "root=") {
			t.Fatalf("process %d: %v: %q", i, errs[i], outs[i])
		}
		if outs[i] != outs[0] {
			t.Errorf("process %d loaded %s; process 0 loaded %s", i, outs[i], outs[0])
		}
	}
}

// TestBuiltinShortLivedCA: with a CA certificate valid for one more hour (cert-manager and
// istio-csr rotate intermediates that often) and SECRET_TTL 24h, leaves end when the CA
// does, with one warning saying so; once the CA has expired, fetches fail naming it.
func TestBuiltinShortLivedCA(t *testing.T) {
	var logs bytes.Buffer
	prev := slog.Default()
	slog.SetDefault(slog.New(slog.NewTextHandler(&logs, nil)))
	t.Cleanup(func() { slog.SetDefault(prev) })

	root := catest.NewRoot(t, "root")
	now := time.Now()
	inter := root.Intermediate(t, "hourly", now.Add(-time.Minute), now.Add(time.Hour))
	c, err := ca.NewBuiltin(inter.WriteCACerts(t), 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []identity.ID{idA, idB} {
		iss, err := c.Fetch(context.Background(), id)
		if err != nil {
			t.Fatalf("fetch %s with a one-hour CA: %v", id, err)
		}
		if got := iss.Certificate.Leaf.NotAfter; !got.Equal(inter.Cert.NotAfter) {
			t.Errorf("leaf NotAfter = %v; want the CA's %v", got, inter.Cert.NotAfter)
		}
	}
	if n := strings.Count(logs.String(), "level=WARN"); n != 1 || !strings.Contains(logs.String(), "SECRET_TTL") {
		t.Errorf("log after two capped leaves:\n%s\nwant one WARN naming SECRET_TTL", logs.String())
	}

	old := root.Intermediate(t, "expired", now.Add(-2*time.Hour), now.Add(-time.Minute))
	c, err = ca.NewBuiltin(old.WriteCACerts(t), 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Fetch(context.Background(), idA)
	want := "CA chain expired at " + old.Cert.NotAfter.UTC().Format(time.RFC3339)
	if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "CN=expired") {
		t.Fatalf("fetch with an expired CA: err = %v; want %q naming CN=expired", err, want)
	}
}
