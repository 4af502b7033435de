package xds

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"strings"
	"sync"
	"time"

	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/gozt/gozt/internal/istiogrpc"
	"github.com/gozt/gozt/xds/state"
	"github.com/gozt/gozt/xds/xdspb/securitypb"
	"github.com/gozt/gozt/xds/xdspb/workloadpb"
)

// The local file (LOCAL_XDS_PATH) in ztunnel's local config shape: camelCase keys, unknown
// keys rejected. Entries are turned into the wire protos and go through the same Convert*
// functions as xDS pushes.

type localConfig struct {
	Workloads []localWorkload `yaml:"workloads"`
	Policies  []localPolicy   `yaml:"policies"`
	Services  []localService  `yaml:"services"`
}

type localGateway struct {
	Destination   string `yaml:"destination"`
	HBONEMtlsPort uint32 `yaml:"hboneMtlsPort"`
}

type localAppTunnel struct {
	Protocol string `yaml:"protocol"`
	Port     uint32 `yaml:"port"`
}

type localLocality struct {
	Region  string `yaml:"region"`
	Zone    string `yaml:"zone"`
	Subzone string `yaml:"subzone"`
}

type localWorkload struct {
	UID                   string                       `yaml:"uid"`
	Name                  string                       `yaml:"name"`
	Namespace             string                       `yaml:"namespace"`
	ServiceAccount        string                       `yaml:"serviceAccount"`
	TrustDomain           string                       `yaml:"trustDomain"`
	WorkloadIPs           []string                     `yaml:"workloadIps"`
	Protocol              string                       `yaml:"protocol"`
	NetworkMode           string                       `yaml:"networkMode"`
	Node                  string                       `yaml:"node"`
	Network               string                       `yaml:"network"`
	Hostname              string                       `yaml:"hostname"`
	Waypoint              *localGateway                `yaml:"waypoint"`
	NetworkGateway        *localGateway                `yaml:"networkGateway"`
	ApplicationTunnel     *localAppTunnel              `yaml:"applicationTunnel"`
	AuthorizationPolicies []string                     `yaml:"authorizationPolicies"`
	Status                string                       `yaml:"status"`
	ClusterID             string                       `yaml:"clusterId"`
	Locality              *localLocality               `yaml:"locality"`
	CanonicalName         string                       `yaml:"canonicalName"`
	CanonicalRevision     string                       `yaml:"canonicalRevision"`
	WorkloadName          string                       `yaml:"workloadName"`
	WorkloadType          string                       `yaml:"workloadType"`
	NativeTunnel          bool                         `yaml:"nativeTunnel"`
	Capacity              *uint32                      `yaml:"capacity"`
	Services              map[string]map[uint32]uint32 `yaml:"services"`
}

type localLB struct {
	RoutingPreferences []string `yaml:"routingPreferences"`
	Mode               string   `yaml:"mode"`
	HealthPolicy       string   `yaml:"healthPolicy"`
}

type localService struct {
	Name            string            `yaml:"name"`
	Namespace       string            `yaml:"namespace"`
	Hostname        string            `yaml:"hostname"`
	VIPs            []string          `yaml:"vips"`
	Ports           map[uint32]uint32 `yaml:"ports"`
	SubjectAltNames []string          `yaml:"subjectAltNames"`
	Waypoint        *localGateway     `yaml:"waypoint"`
	LoadBalancer    *localLB          `yaml:"loadBalancer"`
	IPFamilies      string            `yaml:"ipFamilies"`
	Canonical       bool              `yaml:"canonical"`
	Visibility      string            `yaml:"visibility"`
}

type localSAMatch struct {
	Namespace      string `yaml:"namespace"`
	ServiceAccount string `yaml:"serviceAccount"`
}

type localMatch struct {
	Namespaces          []localStringMatch `yaml:"namespaces"`
	NotNamespaces       []localStringMatch `yaml:"notNamespaces"`
	ServiceAccounts     []localSAMatch     `yaml:"serviceAccounts"`
	NotServiceAccounts  []localSAMatch     `yaml:"notServiceAccounts"`
	Principals          []localStringMatch `yaml:"principals"`
	NotPrincipals       []localStringMatch `yaml:"notPrincipals"`
	SourceIPs           []string           `yaml:"sourceIps"`
	NotSourceIPs        []string           `yaml:"notSourceIps"`
	DestinationIPs      []string           `yaml:"destinationIps"`
	NotDestinationIPs   []string           `yaml:"notDestinationIps"`
	DestinationPorts    []uint32           `yaml:"destinationPorts"`
	NotDestinationPorts []uint32           `yaml:"notDestinationPorts"`
}

type localPolicy struct {
	Name      string           `yaml:"name"`
	Namespace string           `yaml:"namespace"`
	Scope     string           `yaml:"scope"`
	Action    string           `yaml:"action"`
	DryRun    bool             `yaml:"dryRun"`
	Rules     [][][]localMatch `yaml:"rules"`
}

// localStringMatch is a string match in either of two forms: the Rust ztunnel's, whose
// serde_yaml reads an enum only as a tag (!Exact x, !Prefix x, !Suffix x, !Presence []), or
// the map form {Exact: x}, {Prefix: x}, {Suffix: x}, {Presence: []} (what istioctl prints
// back from /config_dump); presence is also the bare Presence or {Presence: {}}.
type localStringMatch struct{ m *securitypb.StringMatch }

func (l *localStringMatch) UnmarshalYAML(n *yaml.Node) error {
	if tag, ok := strings.CutPrefix(n.Tag, "!"); ok && tag != "" && !strings.HasPrefix(tag, "!") {
		return l.set(tag, n)
	}
	if n.Kind == yaml.ScalarNode && n.Value == "Presence" {
		l.m = &securitypb.StringMatch{MatchType: &securitypb.StringMatch_Presence{}}
		return nil
	}
	if n.Kind != yaml.MappingNode || len(n.Content) != 2 {
		return fmt.Errorf("line %d: string match must be !Exact|!Prefix|!Suffix value, {Exact|Prefix|Suffix: value}, Presence or {Presence: []}", n.Line)
	}
	return l.set(n.Content[0].Value, n.Content[1])
}

// set makes the match of kind k with value v.
func (l *localStringMatch) set(k string, v *yaml.Node) error {
	if k == "Presence" {
		if (v.Kind != yaml.SequenceNode && v.Kind != yaml.MappingNode) || len(v.Content) > 0 {
			return fmt.Errorf("line %d: Presence takes no value: write {Presence: []} or Presence", v.Line)
		}
		l.m = &securitypb.StringMatch{MatchType: &securitypb.StringMatch_Presence{}}
		return nil
	}
	if k != "Exact" && k != "Prefix" && k != "Suffix" {
		return fmt.Errorf("line %d: unknown string match %q (want Exact, Prefix, Suffix or Presence)", v.Line, k)
	}
	if v.Kind != yaml.ScalarNode {
		return fmt.Errorf("line %d: %s takes a string", v.Line, k)
	}
	switch k {
	case "Exact":
		l.m = &securitypb.StringMatch{MatchType: &securitypb.StringMatch_Exact{Exact: v.Value}}
	case "Prefix":
		l.m = &securitypb.StringMatch{MatchType: &securitypb.StringMatch_Prefix{Prefix: v.Value}}
	default:
		l.m = &securitypb.StringMatch{MatchType: &securitypb.StringMatch_Suffix{Suffix: v.Value}}
	}
	return nil
}

// locator finds the line of a path like ("workloads", 0, "workloadIps", 1) in the parsed tree.
type locator struct{ root *yaml.Node }

func (l locator) at(path ...any) string {
	n := l.root
	if n != nil && n.Kind == yaml.DocumentNode && len(n.Content) > 0 {
		n = n.Content[0]
	}
	var sb strings.Builder
	line := 0
	if n != nil {
		line = n.Line
	}
	for _, p := range path {
		switch p := p.(type) {
		case string:
			if sb.Len() > 0 {
				sb.WriteByte('.')
			}
			sb.WriteString(p)
			var next *yaml.Node
			if n != nil && n.Kind == yaml.MappingNode {
				for i := 0; i+1 < len(n.Content); i += 2 {
					if n.Content[i].Value == p {
						next = n.Content[i+1]
						line = n.Content[i].Line
						break
					}
				}
			}
			n = next
		case int:
			fmt.Fprintf(&sb, "[%d]", p)
			if n != nil && n.Kind == yaml.SequenceNode && p < len(n.Content) {
				n = n.Content[p]
				line = n.Line
			} else {
				n = nil
			}
		}
	}
	return fmt.Sprintf("line %d: %s", line, sb.String())
}

func parseNetAddr(s string) (*workloadpb.NetworkAddress, error) {
	i := strings.LastIndexByte(s, '/')
	network, rest := "", s
	if i >= 0 {
		network, rest = s[:i], s[i+1:]
	}
	// "net/10.0.0.0/16" is a CIDR VIP: the prefix length follows a second slash.
	if j := strings.LastIndexByte(network, '/'); j >= 0 {
		if _, err := netip.ParseAddr(network[j+1:]); err == nil {
			pfx, err := netip.ParsePrefix(network[j+1:] + "/" + rest)
			if err != nil {
				return nil, fmt.Errorf("invalid CIDR %q", s)
			}
			l := uint32(pfx.Bits())
			return &workloadpb.NetworkAddress{Network: network[:j], Address: pfx.Addr().AsSlice(), Length: &l}, nil
		}
	}
	ip, err := netip.ParseAddr(rest)
	if err != nil {
		return nil, fmt.Errorf("invalid address %q (want network/IP)", s)
	}
	return &workloadpb.NetworkAddress{Network: network, Address: ip.AsSlice()}, nil
}

func parseGateway(g *localGateway) (*workloadpb.GatewayAddress, error) {
	if g == nil {
		return nil, nil
	}
	out := &workloadpb.GatewayAddress{HboneMtlsPort: g.HBONEMtlsPort}
	ns, host, ok := strings.Cut(g.Destination, "/")
	if !ok {
		return nil, fmt.Errorf("destination %q: want network/IP or namespace/hostname", g.Destination)
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		out.Destination = &workloadpb.GatewayAddress_Address{Address: &workloadpb.NetworkAddress{Network: ns, Address: ip.AsSlice()}}
	} else {
		out.Destination = &workloadpb.GatewayAddress_Hostname{Hostname: &workloadpb.NamespacedHostname{Namespace: ns, Hostname: host}}
	}
	return out, nil
}

func enumOf(what, v string, names map[string]int32) (int32, error) {
	if v == "" {
		return 0, nil
	}
	if n, ok := names[v]; ok {
		return n, nil
	}
	return 0, fmt.Errorf("unknown %s %q", what, v)
}

func portList(m map[uint32]uint32) []*workloadpb.Port {
	out := make([]*workloadpb.Port, 0, len(m))
	for k, v := range m {
		out = append(out, &workloadpb.Port{ServicePort: k, TargetPort: v})
	}
	return out
}

func (lw *localWorkload) proto(loc func(...any) string) (*workloadpb.Workload, error) {
	p := &workloadpb.Workload{
		Uid: lw.UID, Name: lw.Name, Namespace: lw.Namespace, ServiceAccount: lw.ServiceAccount,
		TrustDomain: lw.TrustDomain, Node: lw.Node, Network: lw.Network, Hostname: lw.Hostname,
		AuthorizationPolicies: lw.AuthorizationPolicies, ClusterId: lw.ClusterID,
		CanonicalName: lw.CanonicalName, CanonicalRevision: lw.CanonicalRevision,
		WorkloadName: lw.WorkloadName, NativeTunnel: lw.NativeTunnel,
	}
	if p.Uid == "" {
		cluster := lw.ClusterID
		if cluster == "" {
			cluster = istiogrpc.DefaultClusterID
		}
		p.Uid = cluster + "//v1/Pod/" + lw.Namespace + "/" + lw.Name
	}
	for i, s := range lw.WorkloadIPs {
		ip, err := netip.ParseAddr(s)
		if err != nil {
			return nil, fmt.Errorf("%s: invalid IP %q", loc("workloadIps", i), s)
		}
		p.Addresses = append(p.Addresses, ip.AsSlice())
	}
	v, err := enumOf("protocol", lw.Protocol, map[string]int32{"HBONE": 1, "TCP": 0, "NONE": 0})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", loc("protocol"), err)
	}
	p.TunnelProtocol = workloadpb.TunnelProtocol(v)
	if v, err = enumOf("networkMode", lw.NetworkMode, map[string]int32{"Standard": 0, "HostNetwork": 1}); err != nil {
		return nil, fmt.Errorf("%s: %w", loc("networkMode"), err)
	}
	p.NetworkMode = workloadpb.NetworkMode(v)
	if v, err = enumOf("status", lw.Status, map[string]int32{"Healthy": 0, "Unhealthy": 1}); err != nil {
		return nil, fmt.Errorf("%s: %w", loc("status"), err)
	}
	p.Status = workloadpb.WorkloadStatus(v)
	if v, err = enumOf("workloadType", strings.ToLower(lw.WorkloadType), map[string]int32{"deployment": 0, "cronjob": 1, "pod": 2, "job": 3}); err != nil {
		return nil, fmt.Errorf("%s: %w", loc("workloadType"), err)
	}
	p.WorkloadType = workloadpb.WorkloadType(v)
	if p.Waypoint, err = parseGateway(lw.Waypoint); err != nil {
		return nil, fmt.Errorf("%s: %w", loc("waypoint"), err)
	}
	if p.NetworkGateway, err = parseGateway(lw.NetworkGateway); err != nil {
		return nil, fmt.Errorf("%s: %w", loc("networkGateway"), err)
	}
	if at := lw.ApplicationTunnel; at != nil {
		if v, err = enumOf("protocol", at.Protocol, map[string]int32{"NONE": 0, "PROXY": 1}); err != nil {
			return nil, fmt.Errorf("%s: %w", loc("applicationTunnel", "protocol"), err)
		}
		p.ApplicationTunnel = &workloadpb.ApplicationTunnel{Protocol: workloadpb.ApplicationTunnel_Protocol(v), Port: at.Port}
	}
	if l := lw.Locality; l != nil {
		p.Locality = &workloadpb.Locality{Region: l.Region, Zone: l.Zone, Subzone: l.Subzone}
	}
	if lw.Capacity != nil {
		p.Capacity = wrapperspb.UInt32(*lw.Capacity)
	}
	if len(lw.Services) > 0 {
		p.Services = make(map[string]*workloadpb.PortList, len(lw.Services))
		for k, m := range lw.Services {
			p.Services[k] = &workloadpb.PortList{Ports: portList(m)}
		}
	}
	return p, nil
}

func (ls *localService) proto(loc func(...any) string) (*workloadpb.Service, error) {
	p := &workloadpb.Service{
		Name: ls.Name, Namespace: ls.Namespace, Hostname: ls.Hostname, Ports: portList(ls.Ports),
		SubjectAltNames: ls.SubjectAltNames, Canonical: ls.Canonical,
	}
	for i, s := range ls.VIPs {
		a, err := parseNetAddr(s)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", loc("vips", i), err)
		}
		p.Addresses = append(p.Addresses, a)
	}
	var err error
	if p.Waypoint, err = parseGateway(ls.Waypoint); err != nil {
		return nil, fmt.Errorf("%s: %w", loc("waypoint"), err)
	}
	if lb := ls.LoadBalancer; lb != nil {
		plb := &workloadpb.LoadBalancing{}
		scopes := map[string]int32{"Region": 1, "Zone": 2, "Subzone": 3, "Node": 4, "Cluster": 5, "Network": 6}
		for i, s := range lb.RoutingPreferences {
			v, err := enumOf("routing preference", s, scopes)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", loc("loadBalancer", "routingPreferences", i), err)
			}
			plb.RoutingPreference = append(plb.RoutingPreference, workloadpb.LoadBalancing_Scope(v))
		}
		v, err := enumOf("mode", lb.Mode, map[string]int32{"Unspecified": 0, "Strict": 1, "Failover": 2, "Passthrough": 3})
		if err != nil {
			return nil, fmt.Errorf("%s: %w", loc("loadBalancer", "mode"), err)
		}
		plb.Mode = workloadpb.LoadBalancing_Mode(v)
		if v, err = enumOf("healthPolicy", lb.HealthPolicy, map[string]int32{"OnlyHealthy": 0, "AllowAll": 1}); err != nil {
			return nil, fmt.Errorf("%s: %w", loc("loadBalancer", "healthPolicy"), err)
		}
		plb.HealthPolicy = workloadpb.LoadBalancing_HealthPolicy(v)
		p.LoadBalancing = plb
	}
	v, err := enumOf("ipFamilies", ls.IPFamilies, map[string]int32{"Automatic": 0, "IPv4Only": 1, "IPv6Only": 2, "Dual": 3})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", loc("ipFamilies"), err)
	}
	p.IpFamilies = workloadpb.IPFamilies(v)
	if v, err = enumOf("visibility", ls.Visibility, map[string]int32{"Public": 0, "Namespace": 1}); err != nil {
		return nil, fmt.Errorf("%s: %w", loc("visibility"), err)
	}
	p.Visibility = workloadpb.Service_Visibility(v)
	return p, nil
}

func cidrs(in []string, loc func(...any) string, field string) ([]*securitypb.Address, error) {
	var out []*securitypb.Address
	for i, s := range in {
		pfx, err := netip.ParsePrefix(s)
		if err != nil {
			ip, err2 := netip.ParseAddr(s)
			if err2 != nil {
				return nil, fmt.Errorf("%s: invalid CIDR %q", loc(field, i), s)
			}
			pfx = netip.PrefixFrom(ip, ip.BitLen())
		}
		out = append(out, &securitypb.Address{Address: pfx.Addr().AsSlice(), Length: uint32(pfx.Bits())})
	}
	return out, nil
}

func (lp *localPolicy) proto(loc func(...any) string) (*securitypb.Authorization, error) {
	p := &securitypb.Authorization{Name: lp.Name, Namespace: lp.Namespace, DryRun: lp.DryRun}
	v, err := enumOf("scope", lp.Scope, map[string]int32{"Global": 0, "Namespace": 1, "WorkloadSelector": 2})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", loc("scope"), err)
	}
	p.Scope = securitypb.Scope(v)
	if v, err = enumOf("action", lp.Action, map[string]int32{"Allow": 0, "Deny": 1}); err != nil {
		return nil, fmt.Errorf("%s: %w", loc("action"), err)
	}
	p.Action = securitypb.Action(v)
	sms := func(in []localStringMatch) []*securitypb.StringMatch {
		out := make([]*securitypb.StringMatch, len(in))
		for i, s := range in {
			out[i] = s.m
		}
		return out
	}
	sas := func(in []localSAMatch) []*securitypb.ServiceAccountMatch {
		out := make([]*securitypb.ServiceAccountMatch, len(in))
		for i, s := range in {
			out[i] = &securitypb.ServiceAccountMatch{Namespace: s.Namespace, ServiceAccount: s.ServiceAccount}
		}
		return out
	}
	for i, rule := range lp.Rules {
		g := &securitypb.Group{}
		for j, clause := range rule {
			rs := &securitypb.Rules{}
			for k, m := range clause {
				mloc := func(path ...any) string { return loc(append([]any{"rules", i, j, k}, path...)...) }
				pm := &securitypb.Match{
					Namespaces: sms(m.Namespaces), NotNamespaces: sms(m.NotNamespaces),
					Principals: sms(m.Principals), NotPrincipals: sms(m.NotPrincipals),
					ServiceAccounts: sas(m.ServiceAccounts), NotServiceAccounts: sas(m.NotServiceAccounts),
					DestinationPorts: m.DestinationPorts, NotDestinationPorts: m.NotDestinationPorts,
				}
				for _, f := range []struct {
					in    []string
					out   *[]*securitypb.Address
					field string
				}{
					{m.SourceIPs, &pm.SourceIps, "sourceIps"}, {m.NotSourceIPs, &pm.NotSourceIps, "notSourceIps"},
					{m.DestinationIPs, &pm.DestinationIps, "destinationIps"}, {m.NotDestinationIPs, &pm.NotDestinationIps, "notDestinationIps"},
				} {
					if *f.out, err = cidrs(f.in, mloc, f.field); err != nil {
						return nil, err
					}
				}
				rs.Matches = append(rs.Matches, pm)
			}
			g.Rules = append(g.Rules, rs)
		}
		p.Rules = append(p.Rules, g)
	}
	return p, nil
}

// ParseFile parses a local config file's bytes into a full-state batch. Errors name the line
// and field at fault. name is used in error messages.
func ParseFile(name string, data []byte) (*state.Batch, error) {
	var cfg localConfig
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&cfg); err != nil && !errors.Is(err, io.EOF) { // empty file: empty config
		var te *yaml.TypeError
		if errors.As(err, &te) { // one line per problem, each "line N: ..."
			return nil, fmt.Errorf("xds: %s: %s", name, strings.Join(te.Errors, "; "))
		}
		return nil, fmt.Errorf("xds: %s: %w", name, err)
	}
	var root yaml.Node
	_ = yaml.Unmarshal(data, &root) // already parsed once; only needed for line numbers
	loc := locator{&root}
	b := &state.Batch{}
	var err error
	if b.Workloads, err = convertEach(loc, "workloads", cfg.Workloads, (*localWorkload).proto, ConvertWorkload); err != nil {
		return nil, fmt.Errorf("xds: %s: %w", name, err)
	}
	if b.Services, err = convertEach(loc, "services", cfg.Services, (*localService).proto, ConvertService); err != nil {
		return nil, fmt.Errorf("xds: %s: %w", name, err)
	}
	if b.Policies, err = convertEach(loc, "policies", cfg.Policies, (*localPolicy).proto, ConvertAuthorization); err != nil {
		return nil, fmt.Errorf("xds: %s: %w", name, err)
	}
	return b, nil
}

// convertEach converts one section of the file (workloads, services, policies): each entry
// to its proto with toProto, which checks the file's own fields, then to state with the
// converter xDS uses. An error names the entry's line; a converter's error loses its "xds: "
// prefix there, since the caller adds it once for the file.
func convertEach[E, P, T any](loc locator, section string, entries []E, toProto func(*E, func(...any) string) (P, error), convert func(P) (T, error)) ([]T, error) {
	var out []T
	for i := range entries {
		at := func(p ...any) string { return loc.at(append([]any{section, i}, p...)...) }
		p, err := toProto(&entries[i], at)
		if err != nil {
			return nil, err
		}
		t, err := convert(p)
		if err != nil {
			var re *resourceError
			if errors.As(err, &re) {
				err = re
			}
			return nil, fmt.Errorf("%s: %w", at(), err)
		}
		out = append(out, t)
	}
	return out, nil
}

// FileSource is the LOCAL_XDS_PATH source: it replaces what it loaded before on every change of
// the file, leaving resources from xDS alone.
type FileSource struct {
	path  string
	store *state.Store
	log   *slog.Logger

	// PollInterval is how often Run checks the file (default 1s). Set before Run.
	PollInterval time.Duration

	mu        sync.Mutex
	addresses map[string]struct{} // names loaded by the last good file
	policies  map[string]struct{}
	size      int64
	mtime     time.Time
}

// LoadFile loads path into store once; the error names the line and field at fault.
func LoadFile(path string, store *state.Store) (*FileSource, error) {
	l := &FileSource{path: path, store: store, log: slog.Default().With("component", "xds", "file", path)}
	if err := l.reload(); err != nil {
		return nil, err
	}
	return l, nil
}

func (l *FileSource) reload() error {
	fi, err := os.Stat(l.path)
	if err != nil {
		return fmt.Errorf("xds: local config: %w", err)
	}
	data, err := os.ReadFile(l.path)
	if err != nil {
		return fmt.Errorf("xds: local config: %w", err)
	}
	l.mu.Lock()
	l.size, l.mtime = fi.Size(), fi.ModTime()
	l.mu.Unlock()
	b, err := ParseFile(l.path, data)
	if err != nil {
		return err
	}
	addrs := make(map[string]struct{}, len(b.Workloads)+len(b.Services))
	pols := make(map[string]struct{}, len(b.Policies))
	for _, w := range b.Workloads {
		addrs[w.UID] = struct{}{}
	}
	for _, s := range b.Services {
		addrs[s.Key()] = struct{}{}
	}
	for _, p := range b.Policies {
		pols[p.Key()] = struct{}{}
	}
	l.mu.Lock()
	for k := range l.addresses {
		if _, ok := addrs[k]; !ok {
			b.RemoveAddresses = append(b.RemoveAddresses, k)
		}
	}
	for k := range l.policies {
		if _, ok := pols[k]; !ok {
			b.RemovePolicies = append(b.RemovePolicies, k)
		}
	}
	l.addresses, l.policies = addrs, pols
	l.mu.Unlock()
	l.store.Apply(b)
	return nil
}

func (l *FileSource) changed() bool {
	fi, err := os.Stat(l.path)
	if err != nil {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return fi.Size() != l.size || !fi.ModTime().Equal(l.mtime)
}

// Run polls the file and reloads it when its size or mtime changes, until ctx ends. A bad
// file is logged and the previous state kept.
func (l *FileSource) Run(ctx context.Context) error {
	every := l.PollInterval
	if every <= 0 {
		every = time.Second
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if !l.changed() {
			continue
		}
		if err := l.reload(); err != nil {
			l.log.Error("xds: local config rejected, keeping previous state", "error", err)
			continue
		}
		l.log.Info("xds: local config reloaded")
	}
}
