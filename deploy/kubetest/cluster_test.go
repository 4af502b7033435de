//go:build linux

// Package kubetest runs the chart, the rendered manifests and the CA client's token path
// against a real kube-apiserver (built by `make kube-apiserver` into .tools/) backed by a
// real etcd (Debian's etcd-server), both on loopback. There is no controller-manager,
// scheduler or kubelet: objects are stored and admitted, never reconciled, so a DaemonSet
// gets no pods. Everything talks to the apiserver with net/http, helm or kubectl; no
// client-go.
//
// The tests skip when a tool is missing, except under CI=true, where that is a failure.
package kubetest

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/testutil"
)

// repo is the repository root, relative to this package's directory (go test's working directory).
const repo = "../.."

// Tools are found here; the Makefile's kube-apiserver, kubectl and helm targets put them
// there (variables, so a one-off run can point elsewhere with -ldflags -X).
var (
	apiserverBin = repo + "/.tools/kube-apiserver"
	helmBin      = repo + "/.tools/helm"
	kubectlBin   = repo + "/.tools/kubectl"
)

// cluster is one etcd and one kube-apiserver shared by the package's tests (starting them
// takes several seconds); TestMain stops them.
type cluster struct {
	URL        string // https://127.0.0.1:port
	Kubeconfig string // a kubeconfig file for helm and kubectl, as the admin
	token      string // admin bearer token (group system:masters)
	client     *http.Client
	etcdURL    string
	dir        string
	procs      []*exec.Cmd // etcd, kube-apiserver
}

var (
	shared     *cluster
	sharedErr  error
	sharedOnce sync.Once
)

func TestMain(m *testing.M) {
	code := m.Run()
	if shared != nil {
		shared.stop()
	}
	os.Exit(code)
}

// need skips t (fails it under CI=true) unless every tool is there, and returns the
// resolved paths in order.
func need(t *testing.T, tools ...string) []string {
	t.Helper()
	var paths []string
	for _, tool := range tools {
		p, err := exec.LookPath(tool)
		if err != nil {
			msg := fmt.Sprintf("%s not found (%v): run `make k8s-check`, which builds kube-apiserver, kubectl and helm into .tools/; etcd is Debian's etcd-server", tool, err)
			if os.Getenv("CI") == "true" {
				t.Fatal(msg)
			}
			t.Skip(msg)
		}
		if p, err = filepath.Abs(p); err != nil {
			t.Fatal(err)
		}
		paths = append(paths, p)
	}
	return paths
}

// getCluster returns the shared cluster, starting it on first use.
func getCluster(t *testing.T) *cluster {
	t.Helper()
	bins := need(t, "etcd", apiserverBin)
	sharedOnce.Do(func() { shared, sharedErr = start(bins[0], bins[1]) })
	if sharedErr != nil {
		t.Fatal(sharedErr)
	}
	return shared
}

func start(etcd, apiserver string) (*cluster, error) {
	dir, err := os.MkdirTemp("", "kubetest-")
	if err != nil {
		return nil, err
	}
	c := &cluster{dir: dir, token: rand.Text()}
	if err := c.startEtcd(etcd); err != nil {
		c.stop()
		return nil, err
	}
	if err := c.startAPIServer(apiserver); err != nil {
		c.stop()
		return nil, err
	}
	return c, nil
}

// stop kills the processes, kube-apiserver first, waits for them and removes the data directory.
func (c *cluster) stop() {
	for _, p := range slices.Backward(c.procs) {
		p.Process.Kill()
		p.Wait()
	}
	os.RemoveAll(c.dir)
}

// freePort returns a loopback port that was free a moment ago.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// run starts a long-lived process logging to dir/name.log.
func (c *cluster) run(name, bin string, args ...string) error {
	log, err := os.Create(filepath.Join(c.dir, name+".log"))
	if err != nil {
		return err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = log, log
	// Killed with the test binary too when TestMain cannot stop it (a -timeout panic).
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("kubetest: start %s: %w", name, err)
	}
	c.procs = append(c.procs, cmd)
	return nil
}

// logTail is the end of a process's log, for an error message.
func (c *cluster) logTail(name string) string {
	b, _ := os.ReadFile(filepath.Join(c.dir, name+".log"))
	return string(b[max(0, len(b)-3000):])
}

func (c *cluster) startEtcd(bin string) error {
	client, err := freePort()
	if err != nil {
		return err
	}
	peer, err := freePort()
	if err != nil {
		return err
	}
	cu, pu := fmt.Sprintf("http://127.0.0.1:%d", client), fmt.Sprintf("http://127.0.0.1:%d", peer)
	if err := c.run("etcd", bin, "--name=kubetest", "--data-dir="+filepath.Join(c.dir, "etcd"),
		"--listen-client-urls="+cu, "--advertise-client-urls="+cu,
		"--listen-peer-urls="+pu, "--initial-advertise-peer-urls="+pu, "--initial-cluster=kubetest="+pu); err != nil {
		return err
	}
	err = testutil.Poll(30*time.Second, func() error {
		resp, err := http.Get(cu + "/health")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if !bytes.Contains(b, []byte(`"health":"true"`)) {
			return fmt.Errorf("health %s", b)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("kubetest: etcd not healthy: %w\n%s", err, c.logTail("etcd"))
	}
	c.etcdURL = cu
	return nil
}

func (c *cluster) startAPIServer(bin string) error {
	port, err := freePort()
	if err != nil {
		return err
	}
	caPEM, certPEM, keyPEM, err := servingCert()
	if err != nil {
		return err
	}
	saKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	saPub, err := x509.MarshalPKIXPublicKey(&saKey.PublicKey)
	if err != nil {
		return err
	}
	files := map[string][]byte{
		"serving.crt": certPEM,
		"serving.key": keyPEM,
		"sa.key":      pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(saKey)}),
		"sa.pub":      pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: saPub}),
		// token,user,uid,"group,group"
		"tokens.csv": fmt.Appendf(nil, "%s,admin,admin,\"system:masters\"\n", c.token),
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(c.dir, name), data, 0o600); err != nil {
			return err
		}
	}
	f := func(name string) string { return filepath.Join(c.dir, name) }
	if err := c.run("kube-apiserver", bin,
		"--etcd-servers="+c.etcdURL,
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", port),
		"--cert-dir="+f("certs"), "--tls-cert-file="+f("serving.crt"), "--tls-private-key-file="+f("serving.key"),
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+f("sa.pub"), "--service-account-signing-key-file="+f("sa.key"),
		"--token-auth-file="+f("tokens.csv"),
		"--authorization-mode=RBAC", // the admin token's group, system:masters, may do anything
		"--service-cluster-ip-range=10.96.0.0/16",
	); err != nil {
		return err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	c.URL = fmt.Sprintf("https://127.0.0.1:%d", port)
	c.client = &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	// readyz is ready once the post-start hooks ran: RBAC's bootstrap roles and the
	// system priority classes the DaemonSet names are there.
	err = testutil.Poll(3*time.Minute, func() error {
		return c.do(http.MethodGet, "/readyz", nil, nil)
	})
	if err != nil {
		return fmt.Errorf("kubetest: kube-apiserver not ready: %w\n%s", err, c.logTail("kube-apiserver"))
	}
	c.Kubeconfig = f("kubeconfig")
	kubeconfig := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: kubetest
  cluster:
    server: %s
    certificate-authority-data: %s
users:
- name: admin
  user:
    token: %s
contexts:
- name: kubetest
  context: {cluster: kubetest, user: admin}
current-context: kubetest
`, c.URL, base64.StdEncoding.EncodeToString(caPEM), c.token)
	return os.WriteFile(c.Kubeconfig, []byte(kubeconfig), 0o600)
}

// servingCert returns a self-signed CA and a serving certificate for 127.0.0.1 it signed.
func servingCert() (caPEM, certPEM, keyPEM []byte, err error) {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, nil, err
	}
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kubetest-ca"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true, IsCA: true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, caKey.Public(), caKey)
	if err != nil {
		return nil, nil, nil, err
	}
	caCert, _ := x509.ParseCertificate(caDER)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, nil, err
	}
	der, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "kube-apiserver"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, DNSNames: []string{"localhost"},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, caCert, key.Public(), caKey)
	if err != nil {
		return nil, nil, nil, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}),
		pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), nil
}

// apiError is a non-2xx answer.
type apiError struct {
	Code int
	Body string
}

func (e *apiError) Error() string { return fmt.Sprintf("kubetest: HTTP %d: %s", e.Code, e.Body) }

// do sends in (JSON, if not nil) to path as the admin and decodes the answer into out (if
// not nil). A non-2xx answer is an *apiError.
func (c *cluster) do(method, path string, in, out any) error {
	return c.doCtx(context.Background(), method, path, in, out)
}

func (c *cluster) doCtx(ctx context.Context, method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.URL+path, body)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+c.token)
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode/100 != 2 {
		return &apiError{resp.StatusCode, strings.TrimSpace(string(b))}
	}
	if out != nil {
		return json.Unmarshal(b, out)
	}
	return nil
}

// notFound reports whether err is the apiserver's 404.
func notFound(err error) bool {
	var e *apiError
	return errors.As(err, &e) && e.Code == http.StatusNotFound
}

// createNamespace creates a namespace with the given labels.
func (c *cluster) createNamespace(t *testing.T, name string, labels map[string]string) {
	t.Helper()
	ns := map[string]any{"apiVersion": "v1", "kind": "Namespace", "metadata": map[string]any{"name": name, "labels": labels}}
	if err := c.do(http.MethodPost, "/api/v1/namespaces", ns, nil); err != nil {
		t.Fatal(err)
	}
}

// command runs a tool against the cluster (KUBECONFIG set) from the repository root and
// returns its stdout and stderr; a non-zero exit fails t.
func (c *cluster) command(t *testing.T, bin string, args ...string) (stdout, stderr string) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Dir = repo
	cmd.Env = append(os.Environ(), "KUBECONFIG="+c.Kubeconfig, "HELM_CACHE_HOME="+filepath.Join(c.dir, "helm"), "HELM_CONFIG_HOME="+filepath.Join(c.dir, "helm"))
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s %s: %v\nstdout:\n%s\nstderr:\n%s", filepath.Base(bin), strings.Join(args, " "), err, out.String(), errb.String())
	}
	return out.String(), errb.String()
}
