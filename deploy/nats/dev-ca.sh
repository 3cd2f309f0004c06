#!/bin/sh
# Makes a development certificate authority and a NATS server certificate it signs, for the
# compose set-up (deploy/docker-compose.yml) and the tests. Not for production: there, take
# certificates from your PKI or cert-manager (deploy/README.md).
#
#   sh deploy/nats/dev-ca.sh [DIR]      (default: deploy/nats/certs)
#
# Writes DIR/ca.pem (give it to clients: --nats-tls-ca, ETL_COORD_NATS_TLS_CA or NATS_CA), DIR/ca-key.pem, and
# DIR/server-cert.pem + DIR/server-key.pem (the server's `tls` block). The server certificate
# names the hosts clients use: nats (compose and Kubernetes Service), the StatefulSet's pods,
# localhost and 127.0.0.1, and may also authenticate a client: a cluster route dialling a peer
# presents it (the Kubernetes cluster block's mutual TLS). An existing CA in DIR is kept; the
# server certificate is remade.
set -eu
dir="${1:-$(dirname "$0")/certs}"
command -v openssl >/dev/null || { echo "dev-ca.sh: openssl is needed (e.g. apt-get install openssl)" >&2; exit 1; }
for f in ca.pem server-cert.pem server-key.pem; do
  # `docker compose up` before this script makes each missing mounted file a directory.
  if [ -d "$dir/$f" ]; then
    echo "dev-ca.sh: $dir/$f is a directory (docker made it for a mount of a missing file): remove it and run again" >&2
    exit 1
  fi
done
mkdir -p "$dir"
umask 077
if [ ! -f "$dir/ca.pem" ] || [ ! -f "$dir/ca-key.pem" ]; then
  openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -days 825 \
    -subj "/CN=etl-coordination development CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -keyout "$dir/ca-key.pem" -out "$dir/ca.pem" 2>/dev/null
fi
openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -subj "/CN=nats" \
  -keyout "$dir/server-key.pem" -out "$dir/server.csr" 2>/dev/null
cat > "$dir/server.ext" <<EXT
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=DNS:nats,DNS:nats.default.svc,DNS:nats.default.svc.cluster.local,DNS:*.nats-cluster,DNS:*.nats-cluster.default.svc.cluster.local,DNS:localhost,IP:127.0.0.1
EXT
openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca-key.pem" -CAcreateserial \
  -days 825 -extfile "$dir/server.ext" -out "$dir/server-cert.pem" 2>/dev/null
rm -f "$dir/server.csr" "$dir/server.ext" "$dir/ca.srl"
# The server reads its key as whatever user the container runs as; the CA key stays private.
chmod 644 "$dir/ca.pem" "$dir/server-cert.pem" "$dir/server-key.pem"
echo "dev-ca.sh: wrote $dir/ca.pem, $dir/server-cert.pem and $dir/server-key.pem"
