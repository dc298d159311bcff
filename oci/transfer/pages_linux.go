package transfer

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"strings"
)

// rootPeer reports whether the other end of c, a TCP connection on this host's loopback, is a
// socket owned by root (uid 0 in /proc/net/tcp, or /proc/net/tcp6 for IPv6): the shim's CRIU or
// a root sender, not another local user. False for anything it cannot find there.
func rootPeer(c net.Conn) bool {
	ra, ok1 := c.RemoteAddr().(*net.TCPAddr)
	la, ok2 := c.LocalAddr().(*net.TCPAddr)
	if !ok1 || !ok2 {
		return false
	}
	table := "/proc/net/tcp"
	if ra.IP.To4() == nil || la.IP.To4() == nil {
		table = "/proc/net/tcp6"
	}
	f, err := os.Open(table)
	if err != nil {
		return false
	}
	defer f.Close()
	// the peer's socket: local address = c's remote, remote address = c's local
	want := procAddr(ra.IP, ra.Port, table) + " " + procAddr(la.IP, la.Port, table)
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 8 {
			continue
		}
		if fields[1]+" "+fields[2] == want {
			return fields[7] == "0"
		}
	}
	return false
}

// procAddr is ip:port as the table (/proc/net/tcp or tcp6) prints it: each 32-bit word of the
// address in host order (little-endian hosts), then the port, in upper-case hex.
func procAddr(ip net.IP, port int, table string) string {
	b := ip.To4()
	if strings.HasSuffix(table, "6") {
		b = ip.To16()
	}
	if b == nil {
		return ""
	}
	var s strings.Builder
	for i := 0; i+4 <= len(b); i += 4 {
		fmt.Fprintf(&s, "%08X", uint32(b[i+3])<<24|uint32(b[i+2])<<16|uint32(b[i+1])<<8|uint32(b[i]))
	}
	return fmt.Sprintf("%s:%04X", s.String(), port)
}
