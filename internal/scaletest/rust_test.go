package scaletest

import (
	"context"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/gozt/gozt/identity/ca/catest"
	"github.com/gozt/gozt/internal/netns"
	"github.com/gozt/gozt/internal/netns/netnstest"
)

// rustNode runs the Rust ztunnel at bin in a network namespace of its own (its listener
// addresses are not configurable, and other nodes on this machine use the same ports),
// fed over TLS (it speaks only https to its control plane) by an ADS server listening
// inside that namespace. FAKE_CA: certificates do not matter here.
func rustNode(bin string) starter {
	return func(t *testing.T, m *mesh, o runOpts) (controlPlane, *node) {
		netnstest.Require(t)
		ns := netnstest.New(t, "scale")
		h, err := netns.Open("/var/run/netns/" + ns.Name)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { h.Close() })
		sock := netns.Sockets{NS: h}
		root := catest.NewRoot(t, "scale-root")
		cert := root.ServingCert(t, "127.0.0.1", "istiod.istio-system.svc")
		dir := t.TempDir()
		rootFile, tokenFile := filepath.Join(dir, "root-cert.pem"), filepath.Join(dir, "istio-token")
		if err := os.WriteFile(rootFile, root.PEM(), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(tokenFile, []byte("scale-token"), 0o644); err != nil {
			t.Fatal(err)
		}
		ln, err := sock.Listen(context.Background(), "tcp", "127.0.0.1:15010")
		if err != nil {
			t.Fatal(err)
		}
		ads, err := serveADS(m, shapeOwn, ln, grpc.Creds(credentials.NewServerTLSFromCert(&cert)))
		if err != nil {
			t.Fatal(err)
		}
		tr := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			return sock.Dial(ctx, &net.Dialer{Timeout: 5 * time.Second}, network, addr)
		}}
		t.Cleanup(tr.CloseIdleConnections)
		env := append([]string{
			"PATH=" + os.Getenv("PATH"),
			"PROXY_MODE=dedicated", "PROXY_WORKLOAD_INFO=" + ns0Workload,
			"NODE_NAME=node-0", "CLUSTER_ID=Kubernetes",
			"XDS_ADDRESS=https://127.0.0.1:15010", "XDS_ROOT_CA=" + rootFile, "AUTH_TOKEN=" + tokenFile,
			"FAKE_CA=true", "ENABLE_ORIG_SRC=false", "RUST_LOG=warn",
		}, o.env...)
		args := []string{"ip", "netns", "exec", ns.Name, bin} // exec: the child is ztunnel itself
		return ads, launch(t, "rust", "127.0.0.1", &http.Client{Transport: tr, Timeout: time.Minute}, dir, args, env)
	}
}
