//go:build linux

package kubetest

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/ca/catest"
	"github.com/gozt/gozt/internal/istiogrpc"
)

// tokenReview asks the apiserver whether token is valid for audience, as istiod does for
// every CSR, and returns the user it names.
func (c *cluster) tokenReview(ctx context.Context, token, audience string) (string, error) {
	review := map[string]any{
		"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
		"spec": map[string]any{"token": token, "audiences": []string{audience}},
	}
	var out struct {
		Status struct {
			Authenticated bool     `json:"authenticated"`
			Audiences     []string `json:"audiences"`
			Error         string   `json:"error"`
			User          struct {
				Username string `json:"username"`
			} `json:"user"`
		} `json:"status"`
	}
	if err := c.doCtx(ctx, http.MethodPost, "/apis/authentication.k8s.io/v1/tokenreviews", review, &out); err != nil {
		return "", err
	}
	if !out.Status.Authenticated {
		return "", fmt.Errorf("token not authenticated: %s", out.Status.Error)
	}
	if !slices.Contains(out.Status.Audiences, audience) {
		return "", fmt.Errorf("token audiences %q lack %q", out.Status.Audiences, audience)
	}
	return out.Status.User.Username, nil
}

// tokenRequest asks for a token of service account ns/sa, as the kubelet does for a
// projected serviceAccountToken volume; audience "" means the apiserver's default (its issuer).
func (c *cluster) tokenRequest(t *testing.T, ns, sa, audience string, seconds int64) string {
	t.Helper()
	spec := map[string]any{"expirationSeconds": seconds}
	if audience != "" {
		spec["audiences"] = []string{audience}
	}
	req := map[string]any{"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
	var out struct {
		Status struct {
			Token string `json:"token"`
		} `json:"status"`
	}
	if err := c.do(http.MethodPost, "/api/v1/namespaces/"+ns+"/serviceaccounts/"+sa+"/token", req, &out); err != nil {
		t.Fatal(err)
	}
	if out.Status.Token == "" {
		t.Fatal("TokenRequest returned no token")
	}
	return out.Status.Token
}

// The token the chart's istio-token volume carries (a TokenRequest for its service account
// with the volume's audience) is what the node's CA client sends, and a CA that checks it
// with a TokenReview, as istiod does, signs; a token for another audience is refused.
func TestCATokenReview(t *testing.T) {
	c := getCluster(t)
	helm := need(t, helmBin)[0]
	const ns = "ztunnel-token"
	c.createNamespace(t, ns, map[string]string{"pod-security.kubernetes.io/enforce": "privileged"})
	c.command(t, helm, "install", "ztunnel", chart, "--namespace", ns)
	ds, err := c.getDaemonSet(ns, "ztunnel")
	if err != nil {
		t.Fatal(err)
	}
	var audience, path string
	var seconds int64
	for _, v := range ds.Spec.Template.Spec.Volumes {
		if v.Name == "istio-token" && v.Projected != nil && len(v.Projected.Sources) == 1 && v.Projected.Sources[0].ServiceAccountToken != nil {
			s := v.Projected.Sources[0].ServiceAccountToken
			audience, path, seconds = s.Audience, s.Path, s.ExpirationSeconds
		}
	}
	if audience != "istio-ca" || path != "istio-token" {
		t.Fatalf("istio-token volume: audience %q path %q; want istio-ca, istio-token", audience, path)
	}
	sa := ds.Spec.Template.Spec.ServiceAccountName

	srv := catest.StartIstio(t, catest.NewRoot(t, "root"), nil)
	wantUser := "system:serviceaccount:" + ns + ":" + sa
	srv.SetAuthenticate(func(ctx context.Context, authz string) error {
		token, ok := strings.CutPrefix(authz, "Bearer ")
		if !ok {
			return errors.New("no bearer token")
		}
		user, err := c.tokenReview(ctx, token, "istio-ca")
		if err != nil {
			return err
		}
		if user != wantUser {
			return fmt.Errorf("token is for %s; want %s", user, wantUser)
		}
		return nil
	})

	tokenFile := filepath.Join(t.TempDir(), path)
	cli, err := ca.New(context.Background(), ca.Config{Provider: "istio", Config: istiogrpc.Config{Address: "http://" + srv.Addr, TokenFile: tokenFile}})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	id := identity.MustParse("spiffe://cluster.local/ns/" + ns + "/sa/" + sa)
	fetch := func() (*ca.Issued, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		return cli.Fetch(ctx, id)
	}

	for _, tc := range []struct {
		name     string
		audience string
		ok       bool
	}{
		{"the volume's audience", audience, true},
		{"the default audience", "", false},
		{"another audience", "istio-xds", false},
	} {
		tok := c.tokenRequest(t, ns, sa, tc.audience, seconds)
		if err := os.WriteFile(tokenFile, []byte(tok), 0o600); err != nil {
			t.Fatal(err)
		}
		iss, err := fetch()
		if !tc.ok {
			if status.Code(err) != codes.Unauthenticated {
				t.Errorf("%s: err = %v; want Unauthenticated", tc.name, err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if got, _ := iss.Identity(); got != id {
			t.Errorf("%s: issued for %v; want %v", tc.name, got, id)
		}
		reqs := srv.Requests()
		if got := reqs[len(reqs)-1].MD.Get("authorization"); len(got) != 1 || got[0] != "Bearer "+tok {
			t.Errorf("%s: the CA client sent authorization %.20q…; want the TokenRequest's token", tc.name, got)
		}
	}

	// A token for another service account, with the right audience, names the wrong user.
	other := map[string]any{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": map[string]any{"name": "other"}}
	if err := c.do(http.MethodPost, "/api/v1/namespaces/"+ns+"/serviceaccounts", other, nil); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(tokenFile, []byte(c.tokenRequest(t, ns, "other", audience, seconds)), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := fetch(); status.Code(err) != codes.Unauthenticated || !strings.Contains(err.Error(), "serviceaccount:"+ns+":other") {
		t.Errorf("another service account's token: err = %v; want Unauthenticated naming it", err)
	}
}
