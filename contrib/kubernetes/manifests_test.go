// Package kubernetes_test checks the manifests in contrib/kubernetes: every YAML document decodes
// strictly (unknown or misspelled fields fail) into its Kubernetes API type, and the properties
// berth relies on hold (RuntimeClass handler, least-privilege DaemonSets, the restore pod's
// runtime class, annotation and node selector).
package kubernetes_test

import (
	"bytes"
	"maps"
	"net"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/pelletier/go-toml/v2"
	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	nodev1 "k8s.io/api/node/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/klog/v2"
	"sigs.k8s.io/yaml"

	"github.com/berth-dev/berth/cmd/berthctl/kube"
	"github.com/berth-dev/berth/nri/plugin"
	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/fingerprint"
)

// featuresDir is where NFD's local source reads feature files.
const featuresDir = "/etc/kubernetes/node-feature-discovery/features.d"

// objects holds every decoded document, by kind.
type objects struct {
	namespaces     []corev1.Namespace
	configMaps     []corev1.ConfigMap
	daemonSets     []appsv1.DaemonSet
	pods           []corev1.Pod
	runtimeClasses []nodev1.RuntimeClass
	netPolicies    []networkingv1.NetworkPolicy
	admission      []admissionv1.ValidatingAdmissionPolicy
	bindings       []admissionv1.ValidatingAdmissionPolicyBinding
}

// splitDocuments splits a multi-document YAML file on "---" lines and drops documents that hold
// only comments and blank lines.
func splitDocuments(data []byte) [][]byte {
	var docs [][]byte
	var cur bytes.Buffer
	flush := func() {
		for _, line := range strings.Split(cur.String(), "\n") {
			if t := strings.TrimSpace(line); t != "" && !strings.HasPrefix(t, "#") {
				docs = append(docs, slices.Clone(cur.Bytes()))
				break
			}
		}
		cur.Reset()
	}
	for _, line := range strings.SplitAfter(string(data), "\n") {
		if strings.TrimRight(line, " \r\n") == "---" {
			flush()
			continue
		}
		cur.WriteString(line)
	}
	flush()
	return docs
}

// strict decodes doc into v with sigs.k8s.io/yaml's strict mode (unknown fields and duplicate
// keys are errors).
func strict(t *testing.T, name string, doc []byte, v any) {
	t.Helper()
	if err := yaml.UnmarshalStrict(doc, v); err != nil {
		t.Fatalf("%s: strict decode into %T: %v", name, v, err)
	}
}

func load(t *testing.T) objects {
	t.Helper()
	files, err := filepath.Glob("*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	more, _ := filepath.Glob("*.yml")
	files = append(files, more...)
	if len(files) == 0 {
		t.Fatal("no manifests")
	}
	var o objects
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		docs := splitDocuments(data)
		if len(docs) == 0 {
			t.Errorf("%s: no documents", f)
		}
		for i, doc := range docs {
			name := f + "#" + string(rune('0'+i))
			var tm metav1.TypeMeta
			if err := yaml.Unmarshal(doc, &tm); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			switch tm.APIVersion + " " + tm.Kind {
			case "v1 Namespace":
				var v corev1.Namespace
				strict(t, name, doc, &v)
				o.namespaces = append(o.namespaces, v)
			case "v1 ConfigMap":
				var v corev1.ConfigMap
				strict(t, name, doc, &v)
				o.configMaps = append(o.configMaps, v)
			case "v1 Pod":
				var v corev1.Pod
				strict(t, name, doc, &v)
				o.pods = append(o.pods, v)
			case "apps/v1 DaemonSet":
				var v appsv1.DaemonSet
				strict(t, name, doc, &v)
				o.daemonSets = append(o.daemonSets, v)
			case "node.k8s.io/v1 RuntimeClass":
				var v nodev1.RuntimeClass
				strict(t, name, doc, &v)
				o.runtimeClasses = append(o.runtimeClasses, v)
			case "admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy":
				var v admissionv1.ValidatingAdmissionPolicy
				strict(t, name, doc, &v)
				o.admission = append(o.admission, v)
			case "admissionregistration.k8s.io/v1 ValidatingAdmissionPolicyBinding":
				var v admissionv1.ValidatingAdmissionPolicyBinding
				strict(t, name, doc, &v)
				o.bindings = append(o.bindings, v)
			case "networking.k8s.io/v1 NetworkPolicy":
				var v networkingv1.NetworkPolicy
				strict(t, name, doc, &v)
				o.netPolicies = append(o.netPolicies, v)
			default:
				t.Fatalf("%s: unexpected apiVersion %q kind %q (add it to this test)", name, tm.APIVersion, tm.Kind)
			}
		}
	}
	return o
}

func TestSplitDocuments(t *testing.T) {
	docs := splitDocuments([]byte("# only a comment\n---\na: 1\n---\n\n---\nb: 2\n--- \n"))
	if len(docs) != 2 || !strings.Contains(string(docs[0]), "a: 1") || !strings.Contains(string(docs[1]), "b: 2") {
		t.Fatalf("splitDocuments: %q", docs)
	}
}

func TestStrictDecodingRejectsUnknownFields(t *testing.T) {
	var v nodev1.RuntimeClass
	err := yaml.UnmarshalStrict([]byte("apiVersion: node.k8s.io/v1\nkind: RuntimeClass\nmetadata: {name: x}\nhandlr: berth\n"), &v)
	if err == nil {
		t.Fatal("a misspelled field decoded without error: the manifest tests would not catch typos")
	}
}

func TestRuntimeClass(t *testing.T) {
	o := load(t)
	var found bool
	for _, rc := range o.runtimeClasses {
		if rc.Name == "berth" {
			found = true
			if rc.Handler != "berth" {
				t.Errorf("RuntimeClass berth: handler %q, want berth (contrib/containerd/berth.toml's runtime)", rc.Handler)
			}
		}
	}
	if !found {
		t.Fatal("no RuntimeClass named berth")
	}
}

// hostPathsAllowed are, per DaemonSet, the host paths it may mount and whether writable.
var hostPathsAllowed = map[string]map[string]bool{
	"berth-nri":    {"/var/run/nri": true, "/sys": false, "/dev": false, "/var/lib/berth/nri": true},
	"berth-labels": {featuresDir: true, "/usr": false},
	// the agent writes received checkpoints and the collector removes checkpoints there, nothing
	// else; of /etc/berth it reads the configuration and the trusted public keys, never the whole
	// directory (the node's signing key stays out of its reach); it arms copy-mode page streams
	// (a request file and a socket per checkpoint) in the shim's page_stream_dir
	"berth-agent": {"/var/lib/kubelet/checkpoints": true, "/var/lib/berth/checkpoints": true, "/etc/berth/shim.toml": false, "/etc/berth/keys": false, "/run/berth/page-streams": true},
	// the probe reads the host's files (hostPath volumes of moved pods may name any path), never writes
	"berth-probe": {"/": false},
}

// hostPIDAllowed are the DaemonSets that may share the host's PID namespace: the probe, which
// checks host PIDs and asks a GPU backend about them (berth-probe-daemonset.yaml).
var hostPIDAllowed = map[string]bool{"berth-probe": true}

// capabilitiesAllowed are, per DaemonSet and container, the capabilities it may add (to a drop
// of ALL): the agent's receiver runs CRIU's page server for copy-mode moves, which starts only
// with CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE; the latter is the narrower one (in the agent's
// own PID and user namespaces, not the host's: see contrib/TRUST.md).
var capabilitiesAllowed = map[string]map[string][]corev1.Capability{
	"berth-agent": {"agent": {"CHECKPOINT_RESTORE"}},
}

func TestDaemonSetsLeastPrivilege(t *testing.T) {
	o := load(t)
	namespaces := map[string]bool{}
	for _, ns := range o.namespaces {
		namespaces[ns.Name] = true
	}
	gpuTaint := &corev1.Taint{Key: "nvidia.com/gpu", Value: "present", Effect: corev1.TaintEffectNoSchedule}
	seen := map[string]bool{}
	for _, ds := range o.daemonSets {
		seen[ds.Name] = true
		t.Run(ds.Name, func(t *testing.T) {
			if !namespaces[ds.Namespace] {
				t.Errorf("namespace %q is not defined in contrib/kubernetes", ds.Namespace)
			}
			sel, err := metav1.LabelSelectorAsSelector(ds.Spec.Selector)
			if err != nil {
				t.Fatal(err)
			}
			if !sel.Matches(labels.Set(ds.Spec.Template.Labels)) {
				t.Errorf("selector %v does not match the template's labels %v", ds.Spec.Selector, ds.Spec.Template.Labels)
			}
			spec := ds.Spec.Template.Spec
			if (spec.HostPID && !hostPIDAllowed[ds.Name]) || spec.HostNetwork || spec.HostIPC {
				t.Error("uses a host namespace (hostPID, hostNetwork or hostIPC)")
			}
			tolerated := false
			for _, tol := range spec.Tolerations {
				if tol.ToleratesTaint(klog.Background(), gpuTaint, false) {
					tolerated = true
				}
			}
			if !tolerated {
				t.Error("does not tolerate the nvidia.com/gpu NoSchedule taint of GPU nodes")
			}
			allowed, ok := hostPathsAllowed[ds.Name]
			if !ok {
				t.Fatalf("no host path policy for DaemonSet %s in this test", ds.Name)
			}
			hostPaths := map[string]string{}
			for _, v := range spec.Volumes {
				if v.HostPath != nil {
					if _, ok := allowed[v.HostPath.Path]; !ok {
						t.Errorf("volume %s mounts host path %s, not in the allowed set %v", v.Name, v.HostPath.Path, allowed)
					}
					hostPaths[v.Name] = v.HostPath.Path
				}
			}
			// least privilege, the same for every DaemonSet (issue 19): no API token (none of
			// them calls the API server), the runtime's default seccomp profile, every capability
			// dropped before any is added
			if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
				t.Error("mounts a service account token; berth's DaemonSets never call the API server")
			}
			if psc := spec.SecurityContext; psc == nil || psc.SeccompProfile == nil || psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
				t.Error("runs without the RuntimeDefault seccomp profile")
			}
			for _, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
				sc := c.SecurityContext
				if sc == nil {
					t.Errorf("container %s: no securityContext", c.Name)
					continue
				}
				if sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, corev1.Capability("ALL")) {
					t.Errorf("container %s does not drop every capability", c.Name)
				}
				if sc.Privileged != nil && *sc.Privileged {
					t.Errorf("container %s is privileged; NRI plugins and the label writer need only their files", c.Name)
				}
				if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
					t.Errorf("container %s: allowPrivilegeEscalation is not false", c.Name)
				}
				if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
					t.Errorf("container %s: root filesystem not read-only", c.Name)
				}
				if sc.Capabilities != nil && len(sc.Capabilities.Add) > 0 {
					if want := capabilitiesAllowed[ds.Name][c.Name]; !slices.Equal(sc.Capabilities.Add, want) {
						t.Errorf("container %s adds capabilities %v; it may add only %v", c.Name, sc.Capabilities.Add, want)
					}
					if !slices.Contains(sc.Capabilities.Drop, corev1.Capability("ALL")) {
						t.Errorf("container %s adds %v without dropping ALL first (drops %v)", c.Name, sc.Capabilities.Add, sc.Capabilities.Drop)
					}
				}
				if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() || c.Resources.Limits.Memory().IsZero() {
					t.Errorf("container %s: wants cpu and memory requests and a memory limit, has %v", c.Name, c.Resources)
				}
				for _, m := range c.VolumeMounts {
					hp, isHost := hostPaths[m.Name]
					if isHost && !allowed[hp] && !m.ReadOnly {
						t.Errorf("container %s mounts host %s writable; it must be readOnly", c.Name, hp)
					}
					if hp == "/" && (m.RecursiveReadOnly == nil || *m.RecursiveReadOnly != corev1.RecursiveReadOnlyEnabled) {
						t.Errorf("container %s mounts the host's / without recursiveReadOnly: Enabled (its submounts would be writable)", c.Name)
					}
				}
			}
		})
	}
	for name := range hostPathsAllowed {
		if !seen[name] {
			t.Errorf("no DaemonSet %s", name)
		}
	}
}

// TestProbe: the berth-probe DaemonSet is what kubectl berth move execs into (kube.Probes'
// defaults): label, container, the host's / at /host, berthctl probe as its process, hostPID, and
// nothing that listens.
func TestProbe(t *testing.T) {
	ds := daemonSet(t, load(t), "berth-probe")
	spec := ds.Spec.Template.Spec
	if sel, _ := metav1.LabelSelectorAsSelector(ds.Spec.Selector); sel.String() != kube.DefaultProbeSelector || ds.Namespace != kube.DefaultAgentNamespace {
		t.Errorf("selector %v in %s, kube.Probes looks for %s in %s", sel, ds.Namespace, kube.DefaultProbeSelector, kube.DefaultAgentNamespace)
	}
	if !spec.HostPID || spec.HostNetwork || spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
		t.Errorf("hostPID %v, hostNetwork %v, service account token %v: want hostPID only", spec.HostPID, spec.HostNetwork, spec.AutomountServiceAccountToken)
	}
	// with the host's PIDs, uid 0 could signal every root process of the node
	if sc := spec.SecurityContext; sc == nil || sc.RunAsUser == nil || *sc.RunAsUser == 0 || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot {
		t.Errorf("the probe's pod security context %+v: want a non-root runAsUser and runAsNonRoot", sc)
	}
	if len(spec.Containers) != 1 || spec.Containers[0].Name != kube.DefaultProbeContainer {
		t.Fatalf("containers %v: want one named %s", spec.Containers, kube.DefaultProbeContainer)
	}
	c := spec.Containers[0]
	if len(c.Ports) > 0 {
		t.Errorf("the probe declares ports %v: it listens on nothing", c.Ports)
	}
	if !slices.Equal(append(slices.Clone(c.Command), c.Args...), []string{"/usr/local/bin/berthctl", "probe"}) {
		t.Errorf("runs %v %v, want berthctl probe", c.Command, c.Args)
	}
	host := ""
	for _, v := range spec.Volumes {
		if v.HostPath != nil && v.HostPath.Path == "/" {
			host = v.Name
		}
	}
	found := false
	for _, m := range c.VolumeMounts {
		if m.Name == host && m.MountPath == kube.DefaultProbeHostRoot && m.ReadOnly {
			found = true
		}
	}
	if !found {
		t.Errorf("the host's / is not mounted read-only at %s: %v", kube.DefaultProbeHostRoot, c.VolumeMounts)
	}
	gpu := false
	for _, e := range c.Env {
		gpu = gpu || e.Name == "BERTH_GPU"
	}
	if !gpu {
		t.Error("no BERTH_GPU: the GPU backend of the probe's checks")
	}
}

func daemonSet(t *testing.T, o objects, name string) appsv1.DaemonSet {
	t.Helper()
	for _, ds := range o.daemonSets {
		if ds.Name == name {
			return ds
		}
	}
	t.Fatalf("no DaemonSet %s", name)
	return appsv1.DaemonSet{}
}

func TestLabelWriter(t *testing.T) {
	o := load(t)
	ds := daemonSet(t, o, "berth-labels")
	spec := ds.Spec.Template.Spec
	if len(spec.Containers) != 1 {
		t.Fatalf("%d containers, want 1", len(spec.Containers))
	}
	c := spec.Containers[0]
	argv := append(slices.Clone(c.Command), c.Args...)
	if !slices.Contains(argv, "labels") {
		t.Errorf("command %v does not run berthctl labels", argv)
	}
	var file string
	for _, a := range argv {
		if v, ok := strings.CutPrefix(a, "--file="); ok {
			file = v
		}
		if strings.HasPrefix(a, "--interval=") && a == "--interval=0" {
			t.Error("--interval=0 writes once; the label writer must keep the file current")
		}
	}
	if path.Dir(file) != featuresDir || strings.HasPrefix(path.Base(file), ".") {
		t.Errorf("--file %q: want a visible file in %s", file, featuresDir)
	}
	mounted := false
	for _, m := range c.VolumeMounts {
		if m.MountPath == featuresDir && !m.ReadOnly {
			mounted = true
		}
	}
	if !mounted {
		t.Errorf("%s is not mounted writable", featuresDir)
	}
	sc := c.SecurityContext
	if sc == nil || sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, corev1.Capability("ALL")) {
		t.Error("the label writer does not drop all capabilities")
	}
	if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
		t.Error("the label writer mounts a service account token; it never talks to the API server")
	}
}

func TestNRIPlugin(t *testing.T) {
	o := load(t)
	ds := daemonSet(t, o, "berth-nri")
	spec := ds.Spec.Template.Spec
	// The ConfigMap volume names a ConfigMap defined here, whose config berth-nri accepts.
	var cmName string
	for _, v := range spec.Volumes {
		if v.ConfigMap != nil {
			cmName = v.ConfigMap.Name
		}
	}
	var cfg plugin.Config
	var found bool
	for _, cm := range o.configMaps {
		if cm.Name != cmName || cm.Namespace != ds.Namespace {
			continue
		}
		found = true
		for key, body := range cm.Data {
			file := filepath.Join(t.TempDir(), key)
			if err := os.WriteFile(file, []byte(body), 0o600); err != nil {
				t.Fatal(err)
			}
			c, err := plugin.LoadConfig(file, true)
			if err != nil {
				t.Errorf("ConfigMap %s key %s: %v", cm.Name, key, err)
			}
			cfg = c
		}
	}
	if !found {
		t.Fatalf("DaemonSet berth-nri uses ConfigMap %q, not defined in contrib/kubernetes", cmName)
	}
	// The NRI socket the config names lies in a host directory the container mounts.
	c := spec.Containers[0]
	mounts := map[string]string{}
	for _, v := range spec.Volumes {
		if v.HostPath != nil {
			mounts[v.Name] = v.HostPath.Path
		}
	}
	ok := false
	for _, m := range c.VolumeMounts {
		if hp, isHost := mounts[m.Name]; isHost && hp == "/var/run/nri" && path.Dir(cfg.Socket) == m.MountPath && !m.ReadOnly {
			ok = true
		}
	}
	if !ok {
		t.Errorf("NRI socket %q is not inside a writable mount of the host's /var/run/nri", cfg.Socket)
	}
	checkMetricsPort(t, cfg.MetricsAddress, c, o.netPolicies)
	// the record key lies in a writable host directory (it outlives the pod), and no namespace
	// may ask berth-nri for GPUs: under a kubelet they are the device plugin's
	keyDir := false
	for _, m := range c.VolumeMounts {
		if hp, isHost := mounts[m.Name]; isHost && hp == path.Dir(cfg.RecordKeyFile) && m.MountPath == path.Dir(cfg.RecordKeyFile) && !m.ReadOnly {
			keyDir = true
		}
	}
	if cfg.RecordKeyFile == "" || !keyDir {
		t.Errorf("record_key_file %q is not inside a writable mount of the same host directory", cfg.RecordKeyFile)
	}
	if len(cfg.GPUAnnotationNamespaces) != 0 {
		t.Errorf("gpu_annotation_namespaces = %v: under a kubelet no namespace may ask berth-nri for GPUs", cfg.GPUAnnotationNamespaces)
	}
	// least privilege: no token, no capability, RuntimeDefault seccomp, no escalation
	sc := c.SecurityContext
	if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
		t.Error("berth-nri mounts a service account token; it never calls the API server")
	}
	if sc == nil || sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) || len(sc.Capabilities.Add) != 0 ||
		sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		t.Errorf("berth-nri's container security context %+v: want every capability dropped, none added, no escalation, a read-only root", sc)
	}
	if psc := spec.SecurityContext; psc == nil || psc.SeccompProfile == nil || psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Error("berth-nri runs without the RuntimeDefault seccomp profile")
	}
	if spec.HostPID || spec.HostNetwork || spec.HostIPC {
		t.Error("berth-nri shares a host namespace")
	}
}

// checkMetricsPort: berth-nri's metrics are not readable by every pod of the cluster: the
// listener is on the pod's loopback, or it is on the pod's IP behind a container port named
// metrics that a NetworkPolicy of berth-nri's pods admits from named namespaces only.
func checkMetricsPort(t *testing.T, address string, c corev1.Container, policies []networkingv1.NetworkPolicy) {
	t.Helper()
	host, port, err := net.SplitHostPort(address)
	if err != nil {
		t.Fatalf("metrics_address %q: %v", address, err)
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() {
		return
	}
	exposed := false
	for _, p := range c.Ports {
		if p.Name == "metrics" && strconv.Itoa(int(p.ContainerPort)) == port && p.Protocol == corev1.ProtocolTCP {
			exposed = true
		}
	}
	if !exposed {
		t.Errorf("container %s has no TCP port named metrics = %s (metrics_address %q): %+v", c.Name, port, address, c.Ports)
	}
	guarded := false
	for _, np := range policies {
		if np.Spec.PodSelector.MatchLabels["app.kubernetes.io/name"] == "berth-nri" && slices.Contains(np.Spec.PolicyTypes, networkingv1.PolicyTypeIngress) {
			for _, in := range np.Spec.Ingress {
				for _, from := range in.From {
					guarded = guarded || (from.NamespaceSelector != nil && len(from.NamespaceSelector.MatchLabels) > 0)
				}
			}
		}
	}
	if !guarded {
		t.Errorf("metrics_address %q listens on the pod network and no NetworkPolicy limits who may scrape it", address)
	}
}

// exampleFingerprint is the checkpoint fingerprint restore-pod.yaml's nodeSelector is made for.
func exampleFingerprint() fingerprint.Fingerprint {
	return fingerprint.Fingerprint{
		Version: fingerprint.Version, Kernel: "6.8.0-45-generic", Arch: "amd64", CRIU: "4.2.1",
		Runc: "1.5.3", Containerd: "2.4.2",
		CPU:  fingerprint.CPU{Vendor: "GenuineIntel", Flags: []string{"avx2", "avx512f"}},
		GPUs: []fingerprint.GPU{{Index: 0, UUID: "GPU-0", Name: "NVIDIA H200", MemoryBytes: 141 << 30, Driver: "580.65.06", CUDA: "13.0"}},
	}
}

func TestRestorePod(t *testing.T) {
	o := load(t)
	if len(o.pods) == 0 {
		t.Fatal("no restore Pod")
	}
	for _, p := range o.pods {
		if rc := p.Spec.RuntimeClassName; rc == nil || *rc != "berth" {
			t.Errorf("pod %s: runtimeClassName %v, want berth", p.Name, ptrString(rc))
		}
		if p.Annotations[oci.AnnotationRestoreFrom] == "" {
			t.Errorf("pod %s: no %s annotation", p.Name, oci.AnnotationRestoreFrom)
		}
		for k := range p.Annotations {
			if errs := validation.IsQualifiedName(k); len(errs) > 0 {
				t.Errorf("pod %s: annotation key %q: %v", p.Name, k, errs)
			}
		}
		// The annotation passes containerd's pod_annotations filter of the berth runtime.
		if !passedByContainerd(t, oci.AnnotationRestoreFrom) {
			t.Errorf("contrib/containerd/berth.toml's pod_annotations do not pass %s", oci.AnnotationRestoreFrom)
		}
		for k, v := range p.Spec.NodeSelector {
			if errs := validation.IsQualifiedName(k); len(errs) > 0 {
				t.Errorf("nodeSelector key %q: %v", k, errs)
			}
			if errs := validation.IsValidLabelValue(v); len(errs) > 0 {
				t.Errorf("nodeSelector %s value %q: %v", k, v, errs)
			}
		}
		if want := fingerprint.Selector(exampleFingerprint()); !maps.Equal(p.Spec.NodeSelector, want) {
			t.Errorf("pod %s: nodeSelector\n %v\nis not what berthctl checkpoint selector prints for the example checkpoint:\n %v", p.Name, p.Spec.NodeSelector, want)
		}
		if p.Spec.NodeSelector[fingerprint.LabelFingerprint] == "" {
			t.Errorf("pod %s: nodeSelector lacks %s", p.Name, fingerprint.LabelFingerprint)
		}
	}
}

// passedByContainerd reports whether the berth runtime in contrib/containerd/berth.toml passes
// the pod annotation key through (containerd matches pod_annotations with path.Match).
func passedByContainerd(t *testing.T, key string) bool {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("..", "containerd", "berth.toml"))
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		Plugins map[string]struct {
			Containerd struct {
				Runtimes map[string]struct {
					RuntimeType          string   `toml:"runtime_type"`
					PodAnnotations       []string `toml:"pod_annotations"`
					ContainerAnnotations []string `toml:"container_annotations"`
				} `toml:"runtimes"`
			} `toml:"containerd"`
		} `toml:"plugins"`
	}
	if err := toml.Unmarshal(data, &cfg); err != nil {
		t.Fatalf("contrib/containerd/berth.toml: %v", err)
	}
	rt, ok := cfg.Plugins["io.containerd.cri.v1.runtime"].Containerd.Runtimes["berth"]
	if !ok || rt.RuntimeType != "io.containerd.berth.v2" {
		t.Fatalf("contrib/containerd/berth.toml: no berth runtime of type io.containerd.berth.v2: %+v", rt)
	}
	for _, lists := range [][]string{rt.PodAnnotations} {
		for _, pattern := range lists {
			if ok, _ := path.Match(pattern, key); ok {
				return true
			}
		}
	}
	return false
}

func ptrString(p *string) string {
	if p == nil {
		return "(unset)"
	}
	return *p
}

// TestProbeUIDIsItsOwn: the probe runs as a uid that a ValidatingAdmissionPolicy, bound with
// Deny, keeps every pod outside berth-system from (issue 19: as uid 65534 it could read the
// environment of a workload running as nobody).
func TestProbeUIDIsItsOwn(t *testing.T) {
	o := load(t)
	var uid int64 = -1
	for _, ds := range o.daemonSets {
		if ds.Name == "berth-probe" {
			if sc := ds.Spec.Template.Spec.SecurityContext; sc != nil && sc.RunAsUser != nil {
				uid = *sc.RunAsUser
			}
		}
	}
	if uid == 65534 || uid <= 0 {
		t.Fatalf("the probe runs as uid %d: want a uid of its own (not root, not nobody)", uid)
	}
	var found bool
	for _, p := range o.admission {
		if p.Name != "berth-probe-uid" {
			continue
		}
		text := ""
		for _, v := range p.Spec.Variables {
			text += v.Expression + "\n"
		}
		for _, v := range p.Spec.Validations {
			text += v.Expression + "\n"
		}
		found = strings.Contains(text, strconv.FormatInt(uid, 10)) && strings.Contains(text, "berth-system") &&
			strings.Contains(text, "initContainers") && strings.Contains(text, "ephemeralContainers")
		if p.Spec.FailurePolicy == nil || *p.Spec.FailurePolicy != admissionv1.Fail {
			t.Error("berth-probe-uid does not fail closed")
		}
	}
	if !found {
		t.Fatalf("no ValidatingAdmissionPolicy berth-probe-uid that denies uid %d outside berth-system", uid)
	}
	bound := false
	for _, b := range o.bindings {
		bound = bound || (b.Spec.PolicyName == "berth-probe-uid" && slices.Contains(b.Spec.ValidationActions, admissionv1.Deny))
	}
	if !bound {
		t.Error("berth-probe-uid is not bound with validationActions [Deny]")
	}
}
