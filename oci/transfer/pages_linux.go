package transfer

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"strings"
)

// rootPeer reports whether the other end of c, a TCP connection on 127.0.0.1, is a socket owned
// by root (uid 0 in /proc/net/tcp): the shim's CRIU, not another local user racing it to the
// relay's port.
func rootPeer(c net.Conn) bool {
	ra, ok1 := c.RemoteAddr().(*net.TCPAddr)
	la, ok2 := c.LocalAddr().(*net.TCPAddr)
	if !ok1 || !ok2 {
		return false
	}
	f, err := os.Open("/proc/net/tcp")
	if err != nil {
		return false
	}
	defer f.Close()
	// the peer's socket: local address = c's remote, remote address = c's local
	want := fmt.Sprintf("%08X:%04X %08X:%04X", hostOrderIPv4(ra.IP), ra.Port, hostOrderIPv4(la.IP), la.Port)
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

// hostOrderIPv4 is ip as /proc/net/tcp prints it (little-endian hosts).
func hostOrderIPv4(ip net.IP) uint32 {
	v4 := ip.To4()
	if v4 == nil {
		return 0
	}
	return uint32(v4[3])<<24 | uint32(v4[2])<<16 | uint32(v4[1])<<8 | uint32(v4[0])
}
