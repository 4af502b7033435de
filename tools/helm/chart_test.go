package helm

import (
	"flag"
	"os"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
)

var update = flag.Bool("update", false, "rewrite deploy/manifests/ztunnel.yaml from the chart")

const (
	chartDir  = "../../deploy/charts/ztunnel"
	manifests = "../../deploy/manifests/ztunnel.yaml"
	header    = "# Generated from deploy/charts/ztunnel with its default values (make manifests); do not edit.\n"
)

// render is helm template ztunnel deploy/charts/ztunnel -n istio-system with vals.
func render(t *testing.T, vals map[string]any) string {
	t.Helper()
	ch, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	install := action.NewInstall(&action.Configuration{})
	install.DryRun, install.ClientOnly, install.Replace = true, true, true
	install.ReleaseName, install.Namespace = "ztunnel", "istio-system"
	install.KubeVersion = &chartutil.KubeVersion{Version: "v1.32.0", Major: "1", Minor: "32"}
	rel, err := install.Run(ch, vals)
	if err != nil {
		t.Fatal(err)
	}
	return rel.Manifest
}

func TestLint(t *testing.T) {
	for _, vals := range []map[string]any{nil, istioValues()} {
		res := action.NewLint().Run([]string{chartDir}, vals)
		for _, m := range res.Messages {
			if m.Severity > 1 { // above INFO
				t.Errorf("helm lint: %s", m)
			}
		}
		for _, err := range res.Errors {
			t.Errorf("helm lint: %v", err)
		}
	}
}

// The checked-in plain manifests are the chart's output with its defaults. Regenerate with
// make manifests.
func TestManifests(t *testing.T) {
	got := header + render(t, nil)
	if *update {
		if err := os.WriteFile(manifests, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(manifests)
	if err != nil {
		t.Fatal(err)
	}
	if string(want) != got {
		t.Error("deploy/manifests/ztunnel.yaml is not the chart's output: run make manifests")
	}
}

// istioValues are values an Istio ambient release may carry, which helm upgrade
// --reuse-values hands to this chart.
func istioValues() map[string]any {
	return map[string]any{
		"profile":                       "ambient",
		"image":                         "registry.example/gozt/ztunnel:v1",
		"revision":                      "canary",
		"logAsJson":                     true,
		"logLevel":                      "info,access=debug",
		"network":                       "net1",
		"multiCluster":                  map[string]any{"clusterName": "east"},
		"resources":                     map[string]any{"limits": map[string]any{"cpu": "2"}, "requests": map[string]any{"cpu": "200m"}},
		"peerCaCrl":                     map[string]any{"enabled": true},
		"global":                        map[string]any{"networkPolicy": map[string]any{"enabled": true}},
		"resourceQuotas":                map[string]any{"enabled": true, "pods": 100},
		"terminationGracePeriodSeconds": 60,
		"meshConfig":                    map[string]any{"defaultConfig": map[string]any{"proxyMetadata": map[string]any{"ISTIO_META_DNS_CAPTURE": "true"}}},
		"env":                           map[string]any{"KEEPALIVE_TIME": "60s"},
	}
}

// objects splits a rendered manifest into its documents by kind.
func objects(t *testing.T, manifest string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, doc := range strings.Split(manifest, "\n---\n") {
		var m struct{ Kind string }
		if err := yaml.Unmarshal([]byte(doc), &m); err != nil {
			t.Fatal(err)
		}
		if m.Kind != "" {
			out[m.Kind] = doc
		}
	}
	return out
}

// The DaemonSet is what Istio's chart renders for the same values: the container name,
// args, probe, security context, env, mounts, priority class, tolerations and strategy.
func TestIstioValues(t *testing.T) {
	objs := objects(t, render(t, istioValues()))
	for _, kind := range []string{"ServiceAccount", "DaemonSet", "NetworkPolicy", "ResourceQuota"} {
		if objs[kind] == "" {
			t.Errorf("no %s rendered", kind)
		}
	}
	var ds appsv1.DaemonSet
	if err := yaml.UnmarshalStrict([]byte(objs["DaemonSet"]), &ds); err != nil {
		t.Fatal(err)
	}
	pod := ds.Spec.Template.Spec
	if len(pod.Containers) != 1 {
		t.Fatalf("%d containers", len(pod.Containers))
	}
	c := pod.Containers[0]
	env := map[string]string{}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			env[e.Name] = e.Value
		case e.ValueFrom.FieldRef != nil:
			env[e.Name] = "field:" + e.ValueFrom.FieldRef.FieldPath
		case e.ValueFrom.ResourceFieldRef != nil:
			env[e.Name] = "resource:" + e.ValueFrom.ResourceFieldRef.Resource
		}
	}
	for k, want := range map[string]string{
		"CA_ADDRESS": "istiod-canary.istio-system.svc:15012", "XDS_ADDRESS": "istiod-canary.istio-system.svc:15012",
		"LOG_FORMAT": "json", "NETWORK": "net1", "RUST_LOG": "info,access=debug", "RUST_BACKTRACE": "1",
		"ISTIO_META_CLUSTER_ID": "east", "INPOD_ENABLED": "true", "TERMINATION_GRACE_PERIOD_SECONDS": "60",
		"POD_NAME": "field:metadata.name", "POD_NAMESPACE": "field:metadata.namespace", "NODE_NAME": "field:spec.nodeName",
		"INSTANCE_IP": "field:status.podIP", "SERVICE_ACCOUNT": "field:spec.serviceAccountName",
		"ZTUNNEL_CPU_LIMIT": "resource:limits.cpu", "ZTUNNEL_RESOURCE_CPU_LIMIT": "2", "ZTUNNEL_RESOURCE_CPU_REQUEST": "200m",
		"CRL_PATH": "/var/run/secrets/istio/crl/ca-crl.pem", "ISTIO_META_DNS_CAPTURE": "true", "KEEPALIVE_TIME": "60s",
	} {
		if env[k] != want {
			t.Errorf("env %s = %q; want %q", k, env[k], want)
		}
	}
	sc := c.SecurityContext
	caps := sc.Capabilities
	if c.Name != "istio-proxy" || c.Image != "registry.example/gozt/ztunnel:v1" || !slices.Equal(c.Args, []string{"proxy", "ztunnel"}) ||
		c.ReadinessProbe.HTTPGet.Path != "/healthz/ready" || c.ReadinessProbe.HTTPGet.Port.IntValue() != 15021 ||
		!*sc.ReadOnlyRootFilesystem || *sc.RunAsUser != 0 || *sc.RunAsGroup != 1337 || *sc.Privileged || !*sc.AllowPrivilegeEscalation ||
		fmtCaps(caps.Drop) != "ALL" || fmtCaps(caps.Add) != "NET_ADMIN,SYS_ADMIN,NET_RAW" {
		t.Errorf("container differs from Istio's: %+v", c)
	}
	var mounts []string
	for _, m := range c.VolumeMounts {
		mounts = append(mounts, m.MountPath)
	}
	if got := strings.Join(mounts, " "); got != "/var/run/secrets/istio /var/run/secrets/tokens /var/run/ztunnel /tmp /var/run/secrets/istio/crl" {
		t.Errorf("mounts = %s", got)
	}
	if pod.PriorityClassName != "system-node-critical" || *pod.TerminationGracePeriodSeconds != 60 ||
		pod.NodeSelector["kubernetes.io/os"] != "linux" || len(pod.Tolerations) != 3 || pod.HostNetwork ||
		ds.Spec.UpdateStrategy.Type != "RollingUpdate" || ds.Spec.UpdateStrategy.RollingUpdate.MaxUnavailable.IntValue() != 0 || ds.Spec.Selector.MatchLabels["app"] != "ztunnel" ||
		ds.Spec.Template.Labels["istio.io/dataplane-mode"] != "none" || ds.Annotations["istio.io/rev"] != "canary" {
		t.Errorf("pod spec differs from Istio's: %+v", ds.Spec)
	}
	var token *corev1.Volume
	for i, v := range pod.Volumes {
		if v.Name == "istio-token" {
			token = &pod.Volumes[i]
		}
	}
	if token == nil || token.Projected.Sources[0].ServiceAccountToken.Audience != "istio-ca" {
		t.Errorf("istio-token volume = %+v", token)
	}
	if np := objs["NetworkPolicy"]; strings.Count(np, "port: ") != 8 || !strings.Contains(np, "port: 15053, protocol: UDP") {
		t.Errorf("NetworkPolicy ports:\n%s", np)
	}
}

func fmtCaps(cs []corev1.Capability) string {
	var s []string
	for _, c := range cs {
		s = append(s, string(c))
	}
	return strings.Join(s, ",")
}
