//go:build linux

package kubetest

import (
	"errors"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"testing"
)

const chart = "deploy/charts/ztunnel"

// daemonSet is the part of apps/v1 DaemonSet the tests read.
type daemonSet struct {
	Metadata struct {
		Generation int64 `json:"generation"`
	} `json:"metadata"`
	Spec struct {
		Template struct {
			Spec struct {
				ServiceAccountName string `json:"serviceAccountName"`
				Containers         []struct {
					Name string `json:"name"`
					Env  []struct {
						Name  string `json:"name"`
						Value string `json:"value"`
					} `json:"env"`
				} `json:"containers"`
				Volumes []struct {
					Name      string `json:"name"`
					Projected *struct {
						Sources []struct {
							ServiceAccountToken *struct {
								Audience          string `json:"audience"`
								ExpirationSeconds int64  `json:"expirationSeconds"`
								Path              string `json:"path"`
							} `json:"serviceAccountToken"`
						} `json:"sources"`
					} `json:"projected"`
				} `json:"volumes"`
			} `json:"spec"`
		} `json:"template"`
	} `json:"spec"`
}

// env returns the value of the first container's variable name.
func (d *daemonSet) env(name string) string {
	for _, e := range d.Spec.Template.Spec.Containers[0].Env {
		if e.Name == name {
			return e.Value
		}
	}
	return ""
}

func (c *cluster) getDaemonSet(ns, name string) (*daemonSet, error) {
	var ds daemonSet
	err := c.do(http.MethodGet, "/apis/apps/v1/namespaces/"+ns+"/daemonsets/"+name, nil, &ds)
	if err != nil {
		return nil, err
	}
	if len(ds.Spec.Template.Spec.Containers) == 0 {
		return nil, errors.New("kubetest: DaemonSet has no containers")
	}
	return &ds, nil
}

// podSecurityWarning matches the warning Pod Security admission gives for a workload whose
// pods its namespace's level would reject.
var podSecurityWarning = regexp.MustCompile(`would violate PodSecurity "baseline:latest"`)

// The chart's whole life in a privileged namespace, as Istio installs ztunnel in istio-system.
func TestHelmLifecycle(t *testing.T) {
	c := getCluster(t)
	helm := need(t, helmBin)[0]
	const ns = "ztunnel-privileged"
	c.createNamespace(t, ns, map[string]string{
		"pod-security.kubernetes.io/enforce": "privileged",
		"pod-security.kubernetes.io/warn":    "privileged",
	})

	c.command(t, helm, "lint", chart)

	_, stderr := c.command(t, helm, "install", "ztunnel", chart, "--namespace", ns, "--set", "logLevel=info")
	if strings.Contains(stderr, "PodSecurity") {
		t.Errorf("install in a privileged namespace warned:\n%s", stderr)
	}
	ds, err := c.getDaemonSet(ns, "ztunnel")
	if err != nil {
		t.Fatalf("after install: %v", err)
	}
	if got := ds.env("RUST_LOG"); got != "info" {
		t.Errorf("installed RUST_LOG = %q; want info", got)
	}
	if err := c.do(http.MethodGet, "/api/v1/namespaces/"+ns+"/serviceaccounts/"+ds.Spec.Template.Spec.ServiceAccountName, nil, nil); err != nil {
		t.Errorf("the DaemonSet's service account: %v", err)
	}

	c.command(t, helm, "upgrade", "ztunnel", chart, "--namespace", ns, "--reuse-values", "--set", "logLevel=debug")
	up, err := c.getDaemonSet(ns, "ztunnel")
	if err != nil {
		t.Fatalf("after upgrade: %v", err)
	}
	if got := up.env("RUST_LOG"); got != "debug" {
		t.Errorf("upgraded RUST_LOG = %q; want debug", got)
	}
	if up.Metadata.Generation <= ds.Metadata.Generation {
		t.Errorf("generation %d after upgrade; want more than %d", up.Metadata.Generation, ds.Metadata.Generation)
	}
	out, _ := c.command(t, helm, "history", "ztunnel", "--namespace", ns)
	if !strings.Contains(out, "Upgrade complete") {
		t.Errorf("helm history has no completed upgrade:\n%s", out)
	}

	c.command(t, helm, "uninstall", "ztunnel", "--namespace", ns)
	if _, err := c.getDaemonSet(ns, "ztunnel"); !notFound(err) {
		t.Errorf("DaemonSet after uninstall: err = %v; want 404", err)
	}
	if err := c.do(http.MethodGet, "/api/v1/namespaces/"+ns+"/serviceaccounts/ztunnel", nil, nil); !notFound(err) {
		t.Errorf("ServiceAccount after uninstall: err = %v; want 404", err)
	}
	if out, _ := c.command(t, helm, "list", "--namespace", ns, "--short"); strings.TrimSpace(out) != "" {
		t.Errorf("helm list after uninstall = %q; want none", out)
	}
}

// A baseline namespace admits the DaemonSet (Pod Security enforces on pods, which no
// controller creates here) but warns that its pods would be rejected: the node proxy needs
// NET_ADMIN and SYS_ADMIN, and hostPath volumes.
func TestHelmBaselineWarns(t *testing.T) {
	c := getCluster(t)
	helm := need(t, helmBin)[0]
	const ns = "ztunnel-baseline"
	c.createNamespace(t, ns, map[string]string{
		"pod-security.kubernetes.io/enforce": "baseline",
		"pod-security.kubernetes.io/warn":    "baseline",
	})
	_, stderr := c.command(t, helm, "install", "ztunnel", chart, "--namespace", ns)
	stderr = strings.ReplaceAll(stderr, `\"`, `"`) // helm logs the warning as a quoted string
	if !podSecurityWarning.MatchString(stderr) {
		t.Fatalf("install in a baseline namespace: no PodSecurity warning in\n%s", stderr)
	}
	for _, want := range []string{`"NET_ADMIN"`, `"SYS_ADMIN"`, "hostPath"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("the warning does not name %s:\n%s", want, stderr)
		}
	}
	if _, err := c.getDaemonSet(ns, "ztunnel"); err != nil {
		t.Errorf("DaemonSet in the baseline namespace: %v", err)
	}
}

// The rendered manifests pass the apiserver's validation and admission without being stored.
func TestManifestsServerDryRun(t *testing.T) {
	c := getCluster(t)
	kubectl := need(t, kubectlBin)[0]
	c.createNamespace(t, "istio-system", map[string]string{"pod-security.kubernetes.io/enforce": "privileged"})
	out, stderr := c.command(t, kubectl, "apply", "--dry-run=server", "-f", "deploy/manifests/ztunnel.yaml")
	var got []string
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		got = append(got, strings.TrimSuffix(l, " (server dry run)"))
	}
	want := []string{"serviceaccount/ztunnel created", "daemonset.apps/ztunnel created"}
	if !slices.Equal(got, want) {
		t.Errorf("kubectl apply --dry-run=server printed %q; want %q (stderr: %s)", got, want, stderr)
	}
	if _, err := c.getDaemonSet("istio-system", "ztunnel"); !notFound(err) {
		t.Errorf("a server dry run stored the DaemonSet: err = %v", err)
	}
}
